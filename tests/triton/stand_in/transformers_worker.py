"""The model half of the PyTriton test server: transformers on the CPU, driven over stdin/stdout.

``pytriton_server.py`` runs in a Python 3.12 venv that holds PyTriton but no torch (PyPI has
only torch's multi-GB CUDA build for it on this machine). It starts this script with the
project's own interpreter (Python 3.11, CPU torch and transformers) and talks to it in JSON
lines: one object per line, each way. Standalone: it imports nothing of this project.

Requests (stdin)::

    {"op": "generate", "id": 1, "text": "...", "max_new_tokens": 16, "stream": true,
     "generate_kwargs": {"do_sample": false}, "stop_words": ["\\n"], "bad_words": [],
     "seed": null}
    {"op": "cancel", "id": 1}

Replies (stdout)::

    {"ready": true, "pid": 123}               once, when the model is loaded
    {"id": 1, "delta": "Paris"}                streaming only: the next piece of text
    {"id": 1, "done": true, "texts": ["..."]}  the end: every sequence ([] when streaming)
    {"id": 1, "error": "ValueError: ..."}      the end, when generation failed

Requests run one at a time, in arrival order. Stop words are cut off here, so the deltas of a
stream add up to exactly the text a non-streaming request returns. A cancel ends its request
(running or still queued) after the current token; its ``done`` then carries whatever was
produced. End of input means the server is gone: the worker stops generating and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# Set before transformers is imported: no hub is reachable and tokenizers' fork warning is noise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LOGGER = logging.getLogger("transformers_worker")


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
    """The model and its tokenizer; one generation at a time (the worker's main thread)."""

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

    def _generate_kwargs(self, request: dict[str, Any]) -> dict[str, Any]:
        """The request's ``generate`` arguments, its bad words turned into token ids."""
        kwargs = dict(request.get("generate_kwargs") or {})
        bad_ids: list[list[int]] = []
        for word in request.get("bad_words") or []:
            # A word can be tokenized with or without a leading space; ban both spellings.
            for spelling in (word, " " + word):
                ids = self.tokenizer(spelling, add_special_tokens=False)["input_ids"]
                if ids and ids not in bad_ids:
                    bad_ids.append(ids)
        if bad_ids:
            kwargs["bad_words_ids"] = bad_ids
        return kwargs

    def _stopping_criteria(self, *events: threading.Event) -> Any:
        """A criterion ending generation once any of ``events`` is set (cancel, stop word)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self._torch

        class _StopWhenAsked(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                # One flag per sequence, as transformers combines criteria element-wise.
                stop = any(event.is_set() for event in events)
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)

        return StoppingCriteriaList([_StopWhenAsked()])

    def _generate(self, request: dict[str, Any], input_ids: Any, **extra: Any) -> Any:
        with self._torch.inference_mode():
            if request.get("seed") is not None:
                self._torch.manual_seed(int(request["seed"]))
            return self.model.generate(
                input_ids,
                attention_mask=self._torch.ones_like(input_ids),
                max_new_tokens=int(request["max_new_tokens"]),
                **extra,
                **self._generate_kwargs(request),
            )

    def texts(self, request: dict[str, Any], cancel: threading.Event) -> list[str]:
        """Generate every sequence at once (beam search or a non-streaming request)."""
        input_ids = self._input_ids(request["text"])
        output = self._generate(
            request, input_ids, stopping_criteria=self._stopping_criteria(cancel)
        )
        new_tokens = output[:, input_ids.shape[1] :]
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        stop_words = request.get("stop_words") or []
        return [_cut_at_stop(text, stop_words)[0] for text in texts]

    def deltas(self, request: dict[str, Any], cancel: threading.Event) -> Iterator[str]:
        """Generate one sequence and yield its text piece by piece, stop words cut off."""
        from transformers import TextIteratorStreamer

        stop_words = request.get("stop_words") or []
        stop_event = threading.Event()
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        input_ids = self._input_ids(request["text"])
        errors: list[BaseException] = []

        def _run() -> None:
            try:
                self._generate(
                    request,
                    input_ids,
                    streamer=streamer,
                    stopping_criteria=self._stopping_criteria(stop_event, cancel),
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
                text, stopped = _cut_at_stop(text, stop_words)
                if stopped:
                    break
                safe = len(text) - _held_back(text, stop_words)
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
                # Left early (stop word, error): read the streamer to its end so that
                # generate() finishes. Its end marker comes once; reading past it would block
                # forever, hence the flag.
                for _ in streamer:
                    pass
            thread.join()
        if errors:
            raise errors[0]


class Worker:
    """Reads requests from stdin (a thread of its own, so a cancel arrives mid-generation) and
    answers them one at a time on the main thread."""

    def __init__(self, generator: Generator, out: IO[str]) -> None:
        self._generator = generator
        self._out = out
        self._write_lock = threading.Lock()
        self._requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()  # guards the two fields below
        self._cancelled: set[Any] = set()
        self._running: tuple[Any, threading.Event] | None = None

    def send(self, message: dict[str, Any]) -> None:
        """Write one reply line. ASCII JSON: a newline inside a text cannot split the line."""
        line = json.dumps(message, ensure_ascii=True) + "\n"
        try:
            with self._write_lock:
                self._out.write(line)
                self._out.flush()
        except (BrokenPipeError, ValueError):
            # The server closed our stdout: it is gone, nobody is left to answer.
            os._exit(0)

    def read_requests(self, stdin: IO[bytes]) -> None:
        """The reader thread: queue generate requests, act on cancels at once."""
        for line in stdin:
            if not line.strip():
                continue
            try:
                message = json.loads(line)
                op, request_id = message["op"], message["id"]
            except (ValueError, KeyError, TypeError) as exc:
                LOGGER.error("ignoring a malformed request line (%s): %r", exc, line[:200])
                continue
            if op == "cancel":
                with self._lock:
                    self._cancelled.add(request_id)
                    if self._running is not None and self._running[0] == request_id:
                        self._running[1].set()
            elif op == "generate":
                self._requests.put(message)
            else:
                self.send({"id": request_id, "error": f"ValueError: unknown op {op!r}"})
        # End of input: the server is gone or shutting down. Stop whatever runs, then exit.
        with self._lock:
            if self._running is not None:
                self._running[1].set()
        self._requests.put(None)

    def serve(self) -> None:
        """Answer queued requests until the reader sees the end of input."""
        while (request := self._requests.get()) is not None:
            self._answer(request)

    def _answer(self, request: dict[str, Any]) -> None:
        request_id = request["id"]
        cancel = threading.Event()
        with self._lock:
            if request_id in self._cancelled:  # cancelled while queued: nothing to do
                self._cancelled.discard(request_id)
                self.send({"id": request_id, "done": True, "texts": []})
                return
            self._running = (request_id, cancel)
        try:
            if request.get("stream"):
                for delta in self._generator.deltas(request, cancel):
                    if not cancel.is_set():  # the server stopped listening for this request
                        self.send({"id": request_id, "delta": delta})
                self.send({"id": request_id, "done": True, "texts": []})
            else:
                texts = self._generator.texts(request, cancel)
                self.send({"id": request_id, "done": True, "texts": texts})
            if cancel.is_set():
                LOGGER.info("request %s cancelled", request_id)
        except Exception as exc:
            # The stack goes to our stderr (the server's log); the server gets one line.
            traceback.print_exc()
            self.send({"id": request_id, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            with self._lock:
                self._running = None
                self._cancelled.discard(request_id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="Hugging Face model folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    chat_help = "render text as one user message with the model's chat template"
    parser.add_argument("--chat-template", action="store_true", help=chat_help)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Load the model, say ready, answer requests until stdin ends."""
    args = parse_args(argv)
    # Ctrl-C reaches the whole process group; the server then closes our stdin, which ends us
    # cleanly. Dying on SIGINT first would only turn its in-flight requests into errors.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stdout carries the protocol only: keep a private handle to it and point file descriptor 1
    # at stderr, so that stray prints (ours, a library's, C code's) land in the log instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )

    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    LOGGER.info("loading %s (%s)", args.model_dir, args.dtype)
    worker = Worker(Generator(args.model_dir, args.dtype, args.chat_template), out)
    reader = threading.Thread(
        target=worker.read_requests, args=(sys.stdin.buffer,), name="stdin", daemon=True
    )
    reader.start()
    worker.send({"ready": True, "pid": os.getpid()})
    worker.serve()


if __name__ == "__main__":
    main()
