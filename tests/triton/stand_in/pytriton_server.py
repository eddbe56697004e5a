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

Two processes: this standalone script runs in a venv of its own (PyTriton 0.7 needs numpy<2 and a
Python whose ``libpython`` the Python-backend stub can load: 3.12 here) that holds PyTriton and
numpy only. The model runs in ``transformers_worker.py`` beside it, started with the project's
interpreter (``--worker-python``: 3.11, CPU torch and transformers), which answers requests in
JSON lines over its stdin/stdout and streams text as it is generated. Neither imports anything of
this project. Requests take turns on the worker (one model, CPU bound); a worker that dies or
stays silent past ``--worker-timeout`` fails the requests in flight with a Triton error, and the
next request starts a new one.

PyTriton 0.7 does not tell the inference callable when a client goes away (its proxy forwards
requests one way and sends responses without waiting for an answer), so a stream whose client
disconnected runs on to ``max_tokens``; the worker is told to stop whenever the callable itself
is closed early (PyTriton shutting down), which is as far as cancellation reaches.

Usage::

    .venv-triton/bin/python tests/triton/stand_in/pytriton_server.py \\
        --model-dir models/SmolLM2-135M-Instruct --http-port 8010 --grpc-port 8011 \\
        --metrics-port 8012 --model-name ensemble [--worker-python .venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

LOGGER = logging.getLogger("pytriton_server")

REPO_ROOT: Path = Path(__file__).resolve().parents[3]
WORKER_SCRIPT: Path = Path(__file__).resolve().with_name("transformers_worker.py")
#: The worker's interpreter when ``--worker-python`` is not given.
WORKER_PYTHON_ENV: str = "LLM_SUITE_TRITON_WORKER_PYTHON"

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
    #: Turned into token ids by the worker, which has the tokenizer.
    bad_words: list[str] = field(default_factory=list)
    seed: int | None = None

    def worker_request(self) -> dict[str, Any]:
        """The worker's ``generate`` request for these settings (without its id)."""
        return {
            "op": "generate",
            "text": self.prompt,
            "max_new_tokens": self.max_new_tokens,
            "stream": self.stream,
            "generate_kwargs": self.generate_kwargs,
            "stop_words": self.stop_words,
            "bad_words": self.bad_words,
            "seed": self.seed,
        }


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


def read_decoding(inputs: dict[str, np.ndarray]) -> Decoding:
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
    decoding.bad_words = _words(inputs, "bad_words")
    return decoding


class WorkerError(RuntimeError):
    """The worker failed a request, died, or stayed silent too long; the message says which."""


class _WorkerProcess:
    """One run of ``transformers_worker.py`` and the threads that talk to it.

    A reader thread turns the worker's stdout lines into per-request asyncio queues and a writer
    thread feeds its stdin, so PyTriton's event loop never blocks on a pipe. When the worker's
    stdout ends (it died) every request still waiting gets an error at once instead of waiting
    for replies that cannot come.
    """

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # stderr is inherited: the worker's log and tracebacks go where ours go.
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.ready = threading.Event()
        self.failure: str | None = None  # set once the worker is unusable, saying why
        self._lock = threading.Lock()  # guards failure and the pending map
        self._pending: dict[
            int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[dict[str, Any]]]
        ] = {}
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        assert self.process.stdin is not None and self.process.stdout is not None
        threading.Thread(
            target=self._read, args=(self.process.stdout,), name="worker-stdout", daemon=True
        ).start()
        threading.Thread(
            target=self._write, args=(self.process.stdin,), name="worker-stdin", daemon=True
        ).start()

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def register(self, request_id: int) -> asyncio.Queue[dict[str, Any]]:
        """A queue for the replies to ``request_id``, filled on the calling event loop."""
        replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        with self._lock:
            if self.failure is not None:
                raise WorkerError(self.failure)
            self._pending[request_id] = (asyncio.get_running_loop(), replies)
        return replies

    def unregister(self, request_id: int) -> None:
        """Forget ``request_id``: late replies to it are dropped."""
        with self._lock:
            self._pending.pop(request_id, None)

    def send(self, message: dict[str, Any]) -> None:
        """Queue one request line for the worker (never blocks)."""
        self._outbox.put((json.dumps(message, ensure_ascii=True) + "\n").encode("ascii"))

    def close(self) -> None:
        """Close the worker's stdin after what is queued: the worker then exits by itself."""
        self._outbox.put(None)

    def kill(self, reason: str) -> None:
        """Fail every waiting request with ``reason`` and kill the worker (its state is unknown)."""
        self._fail(reason)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = reason
            pending, self._pending = list(self._pending.values()), {}
        self.ready.set()  # wakes a start waiting for the worker to load
        for loop, replies in pending:
            self._deliver(loop, replies, {"error": reason})

    @staticmethod
    def _deliver(
        loop: asyncio.AbstractEventLoop,
        replies: asyncio.Queue[dict[str, Any]],
        message: dict[str, Any],
    ) -> None:
        # asyncio queues are not thread-safe: hand the message to the loop that waits on it.
        with contextlib.suppress(RuntimeError):  # that loop is closed: PyTriton is shutting down
            loop.call_soon_threadsafe(replies.put_nowait, message)

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            try:
                message = json.loads(line)
            except ValueError:
                LOGGER.warning("model worker wrote a line that is not JSON: %r", line[:200])
                continue
            if message.get("ready"):
                LOGGER.info("model worker ready (pid %d)", self.pid)
                self.ready.set()
                continue
            with self._lock:
                target = self._pending.get(message.get("id"))  # None: cancelled, not waited for
            if target is not None:
                self._deliver(*target, message)
        # End of output: the worker exited (or is about to: wait briefly for its status).
        try:
            code: int | str | None = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "unknown: it closed its output but still runs"
        # Exit code 0 is the end of a normal shutdown; anything else is worth a warning.
        level = logging.INFO if code == 0 else logging.WARNING
        LOGGER.log(level, "model worker (pid %d) exited with code %s", self.pid, code)
        self._fail(f"model worker exited with code {code}")

    def _write(self, stdin: IO[bytes]) -> None:
        try:
            while (line := self._outbox.get()) is not None:
                # Blocks only while the worker reads nothing; a timed-out request kills it,
                # which breaks the pipe and ends this thread.
                stdin.write(line)
                stdin.flush()
        except OSError:
            pass  # the worker is gone: the reader sees its output end and fails the requests
        finally:
            with contextlib.suppress(OSError):
                stdin.close()


class ModelWorker:
    """The transformers worker: starts it, restarts it after it died, and runs requests on it.

    Meant for one request at a time (``make_infer_func``'s turns): nothing guards the restart of
    a dead worker against two callers.
    """

    def __init__(
        self, command: list[str], env: dict[str, str], load_timeout: float, reply_timeout: float
    ) -> None:
        self._command = command
        self._env = env
        self.load_timeout = load_timeout
        self.reply_timeout = reply_timeout
        self._ids = itertools.count(1)
        self._current: _WorkerProcess | None = None

    def start(self) -> None:
        """Start a worker process without waiting for it (the model loads meanwhile)."""
        LOGGER.info("starting the model worker: %s", " ".join(self._command))
        self._current = _WorkerProcess(self._command, self._env)

    def wait_ready(self) -> None:
        """Block until the worker has loaded the model; raise :class:`WorkerError` if it never
        does within ``load_timeout`` (the worker is then killed) or exits first."""
        current = self._current
        if current is None:
            raise WorkerError("model worker not started")
        if not current.ready.wait(self.load_timeout):
            current.kill(f"model worker not ready after {self.load_timeout:g} s")
        if current.failure is not None:
            raise WorkerError(current.failure)

    async def _running(self) -> _WorkerProcess:
        """The live worker, a new one (loaded) in place of one that died."""
        if self._current is None or self._current.failure is not None:
            if self._current is not None:
                LOGGER.warning("model worker gone (%s): starting a new one", self._current.failure)
            self.start()
            await asyncio.get_running_loop().run_in_executor(None, self.wait_ready)
        assert self._current is not None
        return self._current

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Run ``request`` on the worker; yield its replies up to the final ``done``.

        Raises :class:`WorkerError` with the worker's error, when it dies, or when it sends
        nothing for ``reply_timeout`` seconds (it is killed then). Closing the generator early
        tells the worker to stop generating.
        """
        worker = await self._running()
        request_id = next(self._ids)
        replies = worker.register(request_id)
        finished = False
        try:
            worker.send({**request, "id": request_id})
            while not finished:
                try:
                    reply = await asyncio.wait_for(replies.get(), self.reply_timeout)
                except TimeoutError:
                    worker.kill(f"model worker sent nothing for {self.reply_timeout:g} s")
                    raise WorkerError(worker.failure) from None
                if "error" in reply:
                    finished = True
                    raise WorkerError(reply["error"])
                finished = bool(reply.get("done"))
                yield reply
        finally:
            worker.unregister(request_id)
            if not finished and worker.failure is None:
                worker.send({"op": "cancel", "id": request_id})

    def stop(self, grace_seconds: float = 5.0) -> None:
        """End the worker: close its stdin, then kill it if it lingers."""
        current, self._current = self._current, None
        if current is None:
            return
        current.close()
        try:
            current.process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            current.kill("model worker stopped")
            current.process.wait(timeout=grace_seconds)


def _text_output(texts: list[str]) -> dict[str, np.ndarray]:
    return {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}


def make_infer_func(worker: ModelWorker) -> Any:
    """The decoupled PyTriton inference callable: an async generator of per-request responses.

    PyTriton drives every request's callable on one event loop thread, so nothing here may
    block it: a blocked loop once deadlocked a request arriving mid-stream. The model runs in
    the worker process and its replies arrive through asyncio queues, each wait bounded by the
    worker's reply timeout. Requests take turns on an ``asyncio.Lock`` (one model, CPU bound:
    running them at once gains nothing).
    """
    turn = asyncio.Lock()

    async def infer(requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        # Without batching Triton hands over one request per call; refuse anything else loudly.
        if len(requests) != 1:
            raise RequestError(f"expected one request per call, got {len(requests)}")
        try:
            decoding = read_decoding(dict(requests[0].items()))
        except RequestError:
            raise
        except Exception as exc:  # malformed tensors: say what was wrong, not a traceback
            raise RequestError(f"bad request: {exc}") from None
        async with turn:
            try:
                # aclosing: leaving early (PyTriton cancelling us) tells the worker to stop now,
                # not whenever the replies generator happens to be garbage collected.
                async with contextlib.aclosing(
                    worker.generate(decoding.worker_request())
                ) as replies:
                    async for reply in replies:
                        if "delta" in reply:
                            yield [_text_output([reply["delta"]])]
                        elif not decoding.stream:  # the final reply carries every sequence
                            yield [_text_output(reply["texts"])]
            except WorkerError as exc:  # the worker's own message: one readable line
                LOGGER.error("generation failed: %s", exc)
                raise RequestError(f"generation failed: {exc}") from None
            except Exception as exc:  # anything else: one readable line, the stack to the log
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
    parser.add_argument("--num-threads", type=int, default=None, help="the worker's torch threads")
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
    parser.add_argument(
        "--worker-python",
        type=Path,
        default=default_worker_python(),
        help="interpreter with torch and transformers that runs the model "
        f"(default: ${WORKER_PYTHON_ENV}, else the repository's .venv/bin/python)",
    )
    parser.add_argument(
        "--worker-load-timeout",
        type=float,
        default=300.0,
        help="seconds the worker may take to load the model",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=300.0,
        help="seconds the worker may stay silent on a request before it counts as hung and is "
        "killed (a non-streaming request is answered once, at its end)",
    )
    return parser.parse_args(argv)


def default_worker_python() -> Path:
    """$LLM_SUITE_TRITON_WORKER_PYTHON, else the project's venv interpreter."""
    # Not resolved: a venv's python is a symlink, and only through the venv's path does it
    # find the venv's packages.
    return Path(os.environ.get(WORKER_PYTHON_ENV) or REPO_ROOT / ".venv" / "bin" / "python")


def _worker_env() -> dict[str, str]:
    """Our environment minus what points a Python at this (3.12) venv's packages."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _exit_on_signal(signum: int, frame: Any) -> None:
    # SystemExit unwinds through ``with Triton(...)``, which stops tritonserver and removes its
    # workspace; the default SIGTERM action would leave both behind. A process started in the
    # background by a non-interactive shell ignores SIGINT, hence the explicit handler for both.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Start the model worker and tritonserver, serve until terminated (SIGTERM or SIGINT)."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.worker_python.exists():
        sys.exit(
            f"error: no worker interpreter {args.worker_python} (build the project's venv with "
            f"`make venv`, or give --worker-python / ${WORKER_PYTHON_ENV})"
        )
    command = [
        str(args.worker_python),
        str(WORKER_SCRIPT),
        "--model-dir",
        str(args.model_dir),
        "--dtype",
        args.dtype,
    ]
    if args.num_threads:
        command += ["--num-threads", str(args.num_threads)]
    if args.chat_template:
        command.append("--chat-template")
    # Taken before our loader path changes below: those are for tritonserver, not the worker.
    worker = ModelWorker(command, _worker_env(), args.worker_load_timeout, args.worker_timeout)
    _libpython_on_loader_path()

    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig

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
    # Started first so that the model loads while tritonserver starts.
    worker.start()
    try:
        with Triton(config=config, workspace=args.workspace) as triton:
            try:
                worker.wait_ready()
            except WorkerError as exc:
                # Not bound yet, so Triton never called the model ready; leaving the with block
                # stops tritonserver.
                LOGGER.error("cannot serve: %s", exc)
                raise SystemExit(1) from None
            triton.bind(
                model_name=args.model_name,
                infer_func=make_infer_func(worker),
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
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
