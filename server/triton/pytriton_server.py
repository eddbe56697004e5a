"""A real Triton Inference Server (PyTriton) serving a Hugging Face causal LM like TensorRT-LLM.

The model it exposes has the inputs and outputs of TensorRT-LLM's ``ensemble`` model (the one
Triton + TensorRT-LLM deployments call through ``POST /v2/models/ensemble/generate``), so Triton's
``generate`` / ``generate_stream`` extension works against it exactly as against a GPU deployment:

* inputs: ``text_input`` (BYTES), ``max_tokens`` (INT32), and optional ``bad_words``,
  ``stop_words`` (BYTES lists), ``end_id``, ``pad_id``, ``top_k``, ``min_length``, ``beam_width``
  (INT32), ``top_p``, ``temperature``, ``length_penalty``, ``repetition_penalty``,
  ``presence_penalty``, ``frequency_penalty`` (FP32), ``random_seed`` (UINT64), ``stream``,
  ``return_log_probs``, ``return_context_logits``, ``return_generation_logits`` (BOOL);
* output: ``text_output`` (BYTES): the generated text without the prompt (TensorRT-LLM's
  ``exclude_input_in_output``), one string per returned beam.

The model is decoupled: with ``stream: true`` every new piece of text is its own response (one
Server-Sent Event on ``generate_stream``), otherwise one response carries the whole text.

Decoding follows TensorRT-LLM's rules, translated to transformers ``generate``: ``beam_width > 1``
is beam search; otherwise the request samples when ``top_k > 1`` or ``top_p > 0`` (both 0, the
defaults, or ``top_k == 1`` or ``temperature == 0`` mean greedy). ``text_input`` is used as is,
like TensorRT-LLM's preprocessing does (no chat template), unless ``--chat-template`` is given.

This is a standalone script for a venv of its own (PyTriton 0.7 needs numpy<2 and a Python whose
``libpython`` the Python-backend stub can load: 3.12 here): it imports nothing of this project.

Usage::

    .venv-triton/bin/python server/triton/pytriton_server.py \\
        --model-dir models/SmolLM2-135M-Instruct --http-port 8010 --grpc-port 8011 \\
        --metrics-port 8012 --model-name ensemble
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import sysconfig
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set before transformers is imported: no hub is reachable and tokenizers' fork warning is noise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

LOGGER = logging.getLogger("pytriton_server")

#: Inputs whose ``true`` asks for outputs this server does not produce.
_UNSUPPORTED_FLAGS = ("return_log_probs", "return_context_logits", "return_generation_logits")
#: Penalties transformers has no equivalent for (it knows only the multiplicative one).
_UNSUPPORTED_PENALTIES = ("presence_penalty", "frequency_penalty")


class RequestError(ValueError):
    """A request the server refuses; the message is what the client sees.

    PyTriton sends a failed request's ``traceback.format_exception`` text as the error. Hiding
    the traceback (the interpreter still keeps it internally) makes that text the one line
    ``RequestError: <message>`` instead of a stack dump of this script.
    """

    @property  # type: ignore[override]
    def __traceback__(self) -> None:
        return None

    @__traceback__.setter
    def __traceback__(self, value: object) -> None:
        pass


@dataclass
class Decoding:
    """One request's decoding settings, read from the Triton input tensors."""

    prompt: str
    max_new_tokens: int
    stream: bool = False
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    stop_words: list[str] = field(default_factory=list)
    seed: int | None = None
    num_sequences: int = 1


def _scalar(inputs: dict[str, np.ndarray], name: str) -> Any:
    """The single value of an optional scalar input, or None when the request omits it."""
    if name not in inputs:
        return None
    array = np.asarray(inputs[name]).reshape(-1)
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got {array.size}")
    value = array[0]
    # BYTES inputs arrive as object arrays of ``bytes``; numeric ones as numpy scalars.
    return value.item() if isinstance(value, np.generic) else value


def _words(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    """A BYTES list input as strings; empty strings (TensorRT-LLM's "none") are dropped."""
    if name not in inputs:
        return []
    words = []
    for item in np.asarray(inputs[name]).reshape(-1):
        word = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        if word:
            words.append(word)
    return words


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_decoding(inputs: dict[str, np.ndarray], tokenizer: Any) -> Decoding:
    """Translate TensorRT-LLM ensemble inputs into transformers ``generate`` arguments.

    Raises :class:`RequestError` naming the input when a value is out of range or unsupported.
    """
    prompt = _text(_scalar(inputs, "text_input"))
    if not prompt:
        raise RequestError("input 'text_input' must not be empty")
    max_tokens = _scalar(inputs, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise RequestError(f"input 'max_tokens' must be >= 1, got {max_tokens}")
    for name in _UNSUPPORTED_FLAGS:
        if _scalar(inputs, name):
            raise RequestError(f"input '{name}' is not supported by this server")
    for name in _UNSUPPORTED_PENALTIES:
        value = _scalar(inputs, name)
        if value:
            raise RequestError(f"input '{name}' is not supported by this server (got {value})")

    decoding = Decoding(prompt=prompt, max_new_tokens=int(max_tokens))
    decoding.stream = bool(_scalar(inputs, "stream") or False)
    decoding.stop_words = _words(inputs, "stop_words")
    kwargs = decoding.generate_kwargs

    beam_width = _scalar(inputs, "beam_width") or 1
    top_k = _scalar(inputs, "top_k") or 0
    top_p = _scalar(inputs, "top_p") or 0.0
    temperature = _scalar(inputs, "temperature")
    if beam_width < 1:
        raise RequestError(f"input 'beam_width' must be >= 1, got {beam_width}")
    if top_k < 0:
        raise RequestError(f"input 'top_k' must be >= 0, got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise RequestError(f"input 'top_p' must be in [0, 1], got {top_p}")
    if temperature is not None and temperature < 0:
        raise RequestError(f"input 'temperature' must be >= 0, got {temperature}")

    if beam_width > 1:
        if decoding.stream:
            raise RequestError("input 'stream' is not supported with 'beam_width' > 1")
        kwargs.update(num_beams=beam_width, num_return_sequences=beam_width, do_sample=False)
        decoding.num_sequences = beam_width
        length_penalty = _scalar(inputs, "length_penalty")
        if length_penalty is not None:
            kwargs["length_penalty"] = float(length_penalty)
    elif (top_k > 1 or top_p > 0.0) and temperature != 0.0:
        # TensorRT-LLM samples as soon as top_k or top_p asks for it; 0/0 means greedy.
        kwargs.update(do_sample=True, top_k=int(top_k), top_p=float(top_p) or 1.0)
        if temperature is not None:
            kwargs["temperature"] = float(temperature)
    else:
        kwargs["do_sample"] = False

    repetition_penalty = _scalar(inputs, "repetition_penalty")
    if repetition_penalty is not None:
        if repetition_penalty <= 0:
            raise RequestError(f"input 'repetition_penalty' must be > 0, got {repetition_penalty}")
        kwargs["repetition_penalty"] = float(repetition_penalty)
    min_length = _scalar(inputs, "min_length")
    if min_length:
        kwargs["min_new_tokens"] = int(min_length)
    end_id = _scalar(inputs, "end_id")
    if end_id is not None:
        kwargs["eos_token_id"] = int(end_id)
    pad_id = _scalar(inputs, "pad_id")
    if pad_id is not None:
        kwargs["pad_token_id"] = int(pad_id)
    seed = _scalar(inputs, "random_seed")
    decoding.seed = None if seed is None else int(seed)

    bad_words = _words(inputs, "bad_words")
    if bad_words:
        # A word can be tokenized with or without a leading space; ban both spellings.
        bad_ids: list[list[int]] = []
        for word in bad_words:
            for spelling in (word, " " + word):
                ids = tokenizer(spelling, add_special_tokens=False)["input_ids"]
                if ids and ids not in bad_ids:
                    bad_ids.append(ids)
        kwargs["bad_words_ids"] = bad_ids
    return decoding


def _cut_at_stop(text: str, stop_words: list[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop word, and whether one was found."""
    cut = min((i for i in (text.find(w) for w in stop_words) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stop_words: list[str]) -> int:
    """How many trailing characters could still become a stop word (not yet safe to send)."""
    longest = 0
    for word in stop_words:
        for size in range(min(len(word) - 1, len(text)), 0, -1):
            if text.endswith(word[:size]):
                longest = max(longest, size)
                break
    return longest


class Generator:
    """The model and its tokenizer; not thread-safe: ``make_infer_func`` runs one at a time."""

    def __init__(self, model_dir: Path, dtype: str, chat_template: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.eval()
        self.chat_template = chat_template

    def _input_ids(self, prompt: str) -> Any:
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}]
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        # The chat template already holds the special tokens; a raw prompt gets the tokenizer's.
        encoded = self.tokenizer(
            prompt, return_tensors="pt", add_special_tokens=not self.chat_template
        )
        return encoded["input_ids"]

    def texts(self, decoding: Decoding) -> list[str]:
        """Generate every sequence at once (beam search or a non-streaming request)."""
        with self._torch.inference_mode():
            if decoding.seed is not None:
                self._torch.manual_seed(decoding.seed)
            input_ids = self._input_ids(decoding.prompt)
            output = self.model.generate(
                input_ids,
                attention_mask=self._torch.ones_like(input_ids),
                max_new_tokens=decoding.max_new_tokens,
                **decoding.generate_kwargs,
            )
            new_tokens = output[:, input_ids.shape[1] :]
            texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return [_cut_at_stop(text, decoding.stop_words)[0] for text in texts]

    def deltas(self, decoding: Decoding) -> Iterator[str]:
        """Generate one sequence and yield its text piece by piece, stop words cut off."""
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        stop_event = threading.Event()

        class _StopWhenAsked(StoppingCriteria):
            """Ends generation once the consumer has seen a stop word (or went away)."""

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> bool:
                return stop_event.is_set()

        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        input_ids = self._input_ids(decoding.prompt)
        errors: list[BaseException] = []

        def _run() -> None:
            try:
                with self._torch.inference_mode():
                    if decoding.seed is not None:
                        self._torch.manual_seed(decoding.seed)
                    self.model.generate(
                        input_ids,
                        attention_mask=self._torch.ones_like(input_ids),
                        max_new_tokens=decoding.max_new_tokens,
                        streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([_StopWhenAsked()]),
                        **decoding.generate_kwargs,
                    )
            except BaseException as exc:  # handed to the consumer thread below
                errors.append(exc)
                streamer.end()

        thread = threading.Thread(target=_run, daemon=True)
        thread.start()
        text, sent, exhausted = "", 0, False
        try:
            for piece in streamer:
                text += piece
                text, stopped = _cut_at_stop(text, decoding.stop_words)
                if stopped:
                    break
                safe = len(text) - _held_back(text, decoding.stop_words)
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
            else:
                exhausted = True
            if len(text) > sent:
                yield text[sent:]
        finally:
            stop_event.set()
            if not exhausted:
                # Left early (stop word, error, client gone): read the streamer to its end
                # so that generate() finishes. Its end marker comes once; reading past it
                # would block forever, hence the flag.
                for _ in streamer:
                    pass
            thread.join()
        if errors:
            raise errors[0]


def _text_output(texts: list[str]) -> dict[str, np.ndarray]:
    return {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}


def make_infer_func(generator: Generator) -> Any:
    """The decoupled PyTriton inference callable: an async generator of per-request responses.

    PyTriton drives every request's callable on one event loop thread. A plain generator would
    block that loop while it waits for the model (between tokens too), so a second request
    arriving mid-stream would block the loop waiting for the first, which then can never
    resume: a deadlock seen here. So the model work runs in executor threads, and requests
    take turns on an ``asyncio.Lock`` (one model, CPU bound: running them at once gains nothing).
    """
    turn = asyncio.Lock()

    async def infer(requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        # Without batching Triton hands over one request per call; refuse anything else loudly.
        if len(requests) != 1:
            raise RequestError(f"expected one request per call, got {len(requests)}")
        try:
            decoding = read_decoding(dict(requests[0].items()), generator.tokenizer)
        except RequestError:
            raise
        except Exception as exc:  # malformed tensors: say what was wrong, not a traceback
            raise RequestError(f"bad request: {exc}") from None
        loop = asyncio.get_running_loop()
        async with turn:
            try:
                if decoding.stream:
                    pieces = generator.deltas(decoding)
                    try:
                        # deltas() yields non-empty strings only, so None marks its end.
                        while (
                            delta := await loop.run_in_executor(None, next, pieces, None)
                        ) is not None:
                            yield [_text_output([delta])]
                    finally:
                        # Ends generation early when we leave before the text is complete.
                        await loop.run_in_executor(None, pieces.close)
                else:
                    texts = await loop.run_in_executor(None, generator.texts, decoding)
                    yield [_text_output(texts)]
            except Exception as exc:  # the model failed: one readable line, the stack to the log
                LOGGER.exception("generation failed")
                raise RequestError(f"generation failed: {type(exc).__name__}: {exc}") from None

    return infer


def _tensors() -> tuple[list[Any], list[Any]]:
    """Inputs and outputs of TensorRT-LLM's ensemble model (shapes without a batch axis)."""
    from pytriton.model_config import Tensor

    def opt(name: str, dtype: Any, shape: tuple[int, ...] = (1,)) -> Any:
        return Tensor(name=name, dtype=dtype, shape=shape, optional=True)

    inputs = [
        Tensor(name="text_input", dtype=bytes, shape=(1,)),
        Tensor(name="max_tokens", dtype=np.int32, shape=(1,)),
        opt("bad_words", bytes, (-1,)),
        opt("stop_words", bytes, (-1,)),
        opt("end_id", np.int32),
        opt("pad_id", np.int32),
        opt("top_k", np.int32),
        opt("top_p", np.float32),
        opt("temperature", np.float32),
        opt("length_penalty", np.float32),
        opt("repetition_penalty", np.float32),
        opt("min_length", np.int32),
        opt("presence_penalty", np.float32),
        opt("frequency_penalty", np.float32),
        opt("random_seed", np.uint64),
        opt("return_log_probs", np.bool_),
        opt("return_context_logits", np.bool_),
        opt("return_generation_logits", np.bool_),
        opt("beam_width", np.int32),
        opt("stream", np.bool_),
    ]
    outputs = [Tensor(name="text_output", dtype=bytes, shape=(-1,))]
    return inputs, outputs


def _libpython_on_loader_path() -> None:
    """Let tritonserver's Python-backend stub find this interpreter's ``libpython``.

    PyTriton starts tritonserver with a copy of our environment, and its stub links against
    ``libpython3.x.so``, which a pyenv or conda Python keeps in its own ``lib`` folder.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir not in current.split(os.pathsep):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, current) if p)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="Hugging Face model folder")
    parser.add_argument("--model-name", default="ensemble", help="Triton model name")
    parser.add_argument("--host", default="127.0.0.1", help="address of all three endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="render text_input as one user message with the model's chat template",
    )
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbosity")
    parser.add_argument(
        "--workspace",
        type=Path,
        default=None,
        help="folder for PyTriton's sockets and tritonserver copy (default: a temporary one)",
    )
    return parser.parse_args(argv)


def _exit_on_signal(signum: int, frame: Any) -> None:
    # SystemExit unwinds through ``with Triton(...)``, which stops tritonserver and removes its
    # workspace; the default SIGTERM action would leave both behind. A process started in the
    # background by a non-interactive shell ignores SIGINT, hence the explicit handler for both.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Load the model, start tritonserver and serve until terminated (SIGTERM or SIGINT)."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _libpython_on_loader_path()

    import torch
    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    LOGGER.info("loading %s (%s)", args.model_dir, args.dtype)
    generator = Generator(args.model_dir, args.dtype, args.chat_template)

    config = TritonConfig(
        http_address=args.host,
        http_port=args.http_port,
        grpc_address=args.host,
        grpc_port=args.grpc_port,
        metrics_address=args.host,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        # Triton waits this long for in-flight requests on shutdown (default 30 s).
        exit_timeout_secs=5,
    )
    inputs, outputs = _tensors()
    with Triton(config=config, workspace=args.workspace) as triton:
        triton.bind(
            model_name=args.model_name,
            infer_func=make_infer_func(generator),
            inputs=inputs,
            outputs=outputs,
            config=ModelConfig(batching=False, decoupled=True),
            strict=True,
        )
        LOGGER.info(
            "serving model %r on http://%s:%d (grpc %d, metrics %d)",
            args.model_name,
            args.host,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
        )
        sys.stdout.flush()
        triton.serve()


if __name__ == "__main__":
    main()
