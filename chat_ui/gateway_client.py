"""A small synchronous client of the gateway's HTTP API, as the chat front end needs it.

The Streamlit page (``chat_ui_app.py``) keeps no HTTP logic of its own: everything that can be
tested without Streamlit lives here.

- :meth:`ChatClient.list_models` reads ``GET /v1/models``;
- :meth:`ChatClient.chat` streams an answer, as a :class:`ChatStream` of text pieces that knows
  its timing and token usage once consumed: greedy and sampling go through the OpenAI-compatible
  ``POST /v1/chat/completions`` (``stream`` with ``stream_options.include_usage``); beam search,
  which that API cannot ask for portably, goes through the native ``POST /generate`` with
  ``messages`` and ``generation_config.num_beams``;
- every failure (gateway down, timeout, an error answer ``{"error": {"message", ...}}`` before or
  during the stream) becomes a :class:`GatewayError` whose message a person can read.

It is synchronous on purpose: a Streamlit script runs in a thread of its own, top to bottom.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from protocol.generation import Usage
from utils.deployment_apps import DEPLOYMENT_FILE_ENV, app_urls

DEFAULT_GATEWAY_URL: str = "http://127.0.0.1:8000"
GATEWAY_URL_ENV: str = "LLM_SUITE_GATEWAY_URL"

DecodingMode = Literal["greedy", "sampling", "beam_search"]
DECODING_LABELS: dict[DecodingMode, str] = {
    "greedy": "Greedy",
    "sampling": "Sampling",
    "beam_search": "Beam search",
}


class GatewayError(RuntimeError):
    """A failed call to the gateway, with a message meant for the person using the page."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: The HTTP status of an error answer; None when no answer came (down, timeout).
        self.status_code = status_code


@dataclass(frozen=True)
class Decoding:
    """How to decode one answer, as picked in the page's sidebar."""

    mode: DecodingMode = "greedy"
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    num_beams: int = 4

    def describe(self) -> str:
        """A short label such as ``sampling (T=0.7, top_p=0.9)``, shown under each answer."""
        if self.mode == "sampling":
            return f"sampling (T={self.temperature:g}, top_p={self.top_p:g})"
        if self.mode == "beam_search":
            return f"beam search ({self.num_beams} beams)"
        return "greedy"


@dataclass(frozen=True)
class ChatStats:
    """What one answer cost: timings measured here, usage as the gateway reported it."""

    #: Seconds from sending the request to the first non-empty piece of text.
    time_to_first_token: float | None
    #: Seconds from sending the request to the end of the stream.
    total_seconds: float
    usage: Usage | None
    finish_reason: str | None
    decoding: str

    @property
    def tokens_per_second(self) -> float | None:
        """Completion tokens over the whole request time (None without usage).

        Over the whole request rather than after the first token: beam search answers in one
        piece at the end, and the two modes should be comparable.
        """
        if self.usage is None or self.total_seconds <= 0:
            return None
        return self.usage.completion_tokens / self.total_seconds

    def summary(self) -> str:
        """One line for the page, e.g. ``TTFT 0.21 s · 35.1 tokens/s · 37 + 8 = 45 tokens``."""
        parts = []
        if self.time_to_first_token is not None:
            parts.append(f"time to first token {self.time_to_first_token:.2f} s")
        rate = self.tokens_per_second
        parts.append(f"{rate:.1f} tokens/s" if rate is not None else "tokens/s n/a")
        if self.usage is not None:
            parts.append(
                f"tokens: {self.usage.prompt_tokens} prompt + {self.usage.completion_tokens} "
                f"completion = {self.usage.total_tokens}"
            )
        else:
            parts.append("token usage not reported")
        parts.append(self.decoding)
        if self.finish_reason == "length":
            parts.append("stopped at max tokens")
        return " · ".join(parts)


def api_messages(history: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages to send for a conversation kept by the page.

    History entries are dicts with ``role`` and ``content``; an assistant entry with an
    ``error`` is a failed exchange: it and the user message it answered are left out, so that a
    refused question does not leave two user turns in a row.
    """
    out: list[dict[str, str]] = []
    for entry in history:
        if entry.get("error"):
            if out and out[-1]["role"] == "user":
                out.pop()
            continue
        out.append({"role": str(entry["role"]), "content": str(entry.get("content") or "")})
    return out


def _error_message(response: httpx.Response, what: str) -> str:
    """A readable message for an error answer: the gateway's own message when it has one."""
    detail = ""
    try:
        body = json.loads(response.read() or b"null")
    except (ValueError, httpx.HTTPError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        detail = str(body["error"].get("message") or "")
    elif isinstance(body, dict) and "detail" in body:
        detail = str(body["detail"])  # a plain FastAPI/Starlette error
    if not detail:
        detail = " ".join(response.text.split())[:300] or response.reason_phrase
    verb = "refused" if response.status_code < 500 else "failed"
    message = f"The gateway {verb} {what} (HTTP {response.status_code}): {detail}"
    retry_after = response.headers.get("retry-after")
    if retry_after:
        message += f" Try again in {retry_after} s."
    return message


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ChatStream:
    """An answer being streamed: iterate it for text pieces; then read ``text`` and ``stats``.

    Iterating it raises :class:`GatewayError` on any failure. It sends its request when the
    iteration starts, so that the time to first token is measured from there.
    """

    def __init__(
        self,
        client: ChatClient,
        path: str,
        body: dict[str, Any],
        decoding: Decoding,
        native: bool,
    ) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._decoding = decoding
        self._native = native
        self.text: str = ""
        self.stats: ChatStats | None = None

    def __iter__(self) -> Iterator[str]:
        return self._run()

    def _run(self) -> Iterator[str]:
        started = time.perf_counter()
        first: float | None = None
        usage: Usage | None = None
        finish_reason: str | None = None
        with self._client._request("POST", self._path, "the chat request", self._body) as response:
            for payload in self._client._events(response):
                if "error" in payload:
                    error = payload["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise GatewayError(f"The answer broke off: {message}")
                if isinstance(payload.get("usage"), dict):
                    counts = payload["usage"]
                    usage = Usage(
                        prompt_tokens=int(counts.get("prompt_tokens") or 0),
                        completion_tokens=int(counts.get("completion_tokens") or 0),
                        total_tokens=int(counts.get("total_tokens") or 0),
                    )
                for choice in payload.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue
                    if self._native:
                        piece = choice.get("text") or ""
                    else:
                        piece = (choice.get("delta") or {}).get("content") or ""
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if piece:
                        if first is None:
                            first = time.perf_counter() - started
                        self.text += piece
                        yield piece
        self.stats = ChatStats(
            time_to_first_token=first,
            total_seconds=time.perf_counter() - started,
            usage=usage,
            finish_reason=finish_reason,
            decoding=self._decoding.describe(),
        )


class ChatClient:
    """Calls the gateway at ``base_url`` (see the module docstring)."""

    def __init__(
        self,
        base_url: str = DEFAULT_GATEWAY_URL,
        timeout_seconds: float = 300.0,
        connect_timeout_seconds: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_seconds, connect=connect_timeout_seconds),
            # A proxy from the environment must not intercept calls to a local gateway.
            trust_env=not _is_loopback(self.base_url),
            transport=transport,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP helpers ------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, what: str, body: dict[str, Any] | None = None
    ) -> _Call:
        return _Call(self, method, path, what, body)

    @staticmethod
    def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
        """JSON payloads of a Server-Sent Events answer, up to ``[DONE]``."""
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line or not data:
                continue  # comments, other fields, blank lines between events
            text = "\n".join(data)
            data = []
            if text == "[DONE]":
                return
            try:
                payload = json.loads(text)
            except ValueError:
                raise GatewayError(f"The gateway sent an unreadable event: {text[:200]}") from None
            if isinstance(payload, dict):
                yield payload

    # -- API ---------------------------------------------------------------------------------

    def list_models(self) -> list[str]:
        """Model ids served through the gateway (``GET /v1/models``), in its order."""
        with self._request("GET", "/v1/models", "the model list") as response:
            try:
                body = json.loads(response.read())
                return [str(card["id"]) for card in body["data"]]
            except (ValueError, KeyError, TypeError):
                raise GatewayError(
                    f"The gateway's model list is not readable: {response.text[:200]}"
                ) from None

    def chat(self, model: str, messages: list[dict[str, str]], decoding: Decoding) -> ChatStream:
        """Start streaming the answer to ``messages`` (nothing is sent before iteration)."""
        if decoding.mode == "beam_search":
            body: dict[str, Any] = {
                "model": model,
                "messages": messages,
                "generation_config": {
                    "max_new_tokens": decoding.max_tokens,
                    "num_beams": decoding.num_beams,
                    "do_sample": False,
                },
                "stream": True,
            }
            return ChatStream(self, "/generate", body, decoding, native=True)
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": decoding.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if decoding.mode == "sampling":
            body.update(temperature=decoding.temperature, top_p=decoding.top_p)
        else:
            body["temperature"] = 0  # OpenAI's way to ask for greedy decoding
        return ChatStream(self, "/v1/chat/completions", body, decoding, native=False)


class _Call:
    """One request as a context manager: yields a 2xx response or raises GatewayError."""

    def __init__(
        self, client: ChatClient, method: str, path: str, what: str, body: dict[str, Any] | None
    ) -> None:
        self._client = client
        self._method = method
        self._path = path
        self._what = what
        self._body = body
        self._response: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        client = self._client
        url = client.base_url
        request = client._http.build_request(self._method, self._path, json=self._body)
        try:
            response = client._http.send(request, stream=True)
        except httpx.ConnectError:
            raise GatewayError(
                f"Cannot reach the gateway at {url}: is it running? "
                "Start it with `python start_app.py up`."
            ) from None
        except httpx.TimeoutException:
            raise GatewayError(f"The gateway at {url} did not answer in time.") from None
        except httpx.HTTPError as exc:
            raise GatewayError(f"Talking to the gateway at {url} failed: {exc}") from None
        self._response = response
        if response.status_code >= 400:
            try:
                message = _error_message(response, self._what)
            finally:
                response.close()
            raise GatewayError(message, status_code=response.status_code)
        return response

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._response is not None:
            self._response.close()
        # Transport errors in the middle of a stream become readable too.
        if isinstance(exc, httpx.TimeoutException):
            raise GatewayError(
                f"The gateway at {self._client.base_url} stopped answering in time."
            ) from None
        if isinstance(exc, httpx.HTTPError):
            raise GatewayError(
                f"The connection to the gateway at {self._client.base_url} broke: {exc}"
            ) from None


def gateway_url_from(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The gateway URL: ``--gateway-url`` in ``argv``, else ``$LLM_SUITE_GATEWAY_URL``, else
    :data:`DEFAULT_GATEWAY_URL`. Either may name the gateway's app in the deployment file the
    launcher started us from (``$LLM_SUITE_DEPLOYMENT_FILE``) instead of a URL, so that its
    port is written in one place.

    Unknown arguments are ignored: under Streamlit's test harness ``argv`` is pytest's.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--gateway-url")
    args, _ = parser.parse_known_args(list(argv))
    url = args.gateway_url or environ.get(GATEWAY_URL_ENV) or DEFAULT_GATEWAY_URL
    deployment = environ.get(DEPLOYMENT_FILE_ENV)
    if "://" not in url and deployment:
        urls = app_urls(deployment)
        if url not in urls:
            raise ValueError(f"{url!r} is no app of the deployment {deployment}")
        return urls[url]
    return url
