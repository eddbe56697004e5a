"""The cases of ``probe_bad_clients.py``: bad requests and auth checks, each a raw HTTP request
(bytes, so that broken framing can be sent too) with the statuses that would be correct."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Case:
    """One request: where it goes, what it is, which statuses are a correct answer."""

    name: str
    raw: bytes
    expected: tuple[int, ...]
    target: str = "gateway"  # or "server": the CB server, called directly


def request(
    method: str,
    path: str,
    body: bytes | str | dict | list | None = None,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    """A complete HTTP/1.1 request asking the server to close after its answer."""
    if body is not None and not isinstance(body, bytes):
        body = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: probe", "Connection: close"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + (body or b"")


def chunked(path: str, total_bytes: int, key: str | None) -> bytes:
    """A chunked POST of ``total_bytes`` spaces without Content-Length."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n{auth}"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    return head + chunk * (total_bytes // 65536) + b"0\r\n\r\n"


def bad_request_cases(key: str) -> list[Case]:
    """Bad input for the gateway (with a valid caller key) and the CB server directly."""
    gen = "/generate"
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    user = [{"role": "user", "content": "Hi"}]
    nested = "[" * 5000 + "]" * 5000
    cases = [
        ("not JSON", "POST", gen, '{"prompt": ', 400),
        ("JSON array", "POST", gen, [], 400),
        ("empty body", "POST", gen, "", 400),
        ("neither prompt nor messages", "POST", gen, {"model": MODEL}, 400),
        ("prompt and messages", "POST", gen, {"prompt": "a", "messages": user}, 400),
        (
            "negative temperature",
            "POST",
            chat,
            {"model": MODEL, "messages": user, "temperature": -1},
            400,
        ),
        (
            "max_new_tokens 0",
            "POST",
            gen,
            {"prompt": "a", "model": MODEL, "generation_config": {"max_new_tokens": 0}},
            400,
        ),
        ("top_p 2", "POST", comp, {"model": MODEL, "prompt": "a", "top_p": 2}, 400),
        ("unknown model", "POST", chat, {"model": "no-such-model", "messages": user}, 404),
        ("logprobs", "POST", chat, {"model": MODEL, "messages": user, "logprobs": True}, 400),
        (
            "tools",
            "POST",
            chat,
            {"model": MODEL, "messages": user, "tools": [{"type": "function"}]},
            400,
        ),
        ("n 0", "POST", comp, {"model": MODEL, "prompt": "a", "n": 0}, 400),
        (
            "bad role",
            "POST",
            chat,
            {"model": MODEL, "messages": [{"role": "x", "content": "a"}]},
            400,
        ),
        (
            "lone surrogate",
            "POST",
            chat,
            # Raw text: json.dumps would escape the backslash of the lone surrogate.
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}',
            400,
        ),
        ("JSON nested 5000 deep", "POST", gen, f'{{"prompt": {nested}}}', 400),
        (
            "stop_token_ids outside the vocabulary",
            "POST",
            comp,
            {"model": MODEL, "prompt": "a", "stop_token_ids": [10**9], "min_tokens": 2},
            400,
        ),
        (
            "stop_token_ids 10**30",
            "POST",
            gen,
            f'{{"model": "{MODEL}", "prompt": "a", '
            f'"generation_config": {{"stop_token_ids": [{10**30}]}}}}',
            400,
        ),
        (
            "token-id prompt outside the vocabulary",
            "POST",
            comp,
            {"model": MODEL, "prompt": [10**8]},
            400,
        ),
        (
            "prompt longer than the context",
            "POST",
            comp,
            {"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 1},
            400,
        ),
        ("GET on a POST route", "GET", gen, None, 405),
        ("unknown path", "GET", "/no/such/path", None, 404),
        ("Triton without text_input", "POST", "/v2/models/ensemble/generate", {}, 400),
        (
            "Triton beam_width 0",
            "POST",
            "/v2/models/ensemble/generate",
            {"text_input": "a", "beam_width": 0},
            400,
        ),
        ("body over the limit", "POST", gen, {"prompt": "a" * 2_000_000}, 413),
    ]
    out = [Case(name, request(m, p, b, key=key), (status,)) for name, m, p, b, status in cases]
    out.append(
        Case(
            "unknown X-LLM-Route",
            request(
                "POST",
                gen,
                {"prompt": "a", "model": MODEL},
                key=key,
                headers={"X-LLM-Route": "moon"},
            ),
            (400,),
        )
    )
    out += _framing_cases(key, "gateway")
    # The CB server called directly gets the cases that reach past the gateway's checks.
    server_names = {
        "lone surrogate",
        "JSON nested 5000 deep",
        "stop_token_ids 10**30",
        "stop_token_ids outside the vocabulary",
        "body over the limit",
    }
    for name, method, path, body, status in cases:
        if name in server_names:
            out.append(Case(f"server: {name}", request(method, path, body), (status,), "server"))
    out += _framing_cases(None, "server")
    return out


def _framing_cases(key: str | None, target: str) -> list[Case]:
    """HTTP framing that uvicorn itself refused in text/plain (or not at all)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    prefix = "server: " if target == "server" else ""
    head = f"POST /generate HTTP/1.1\r\nHost: probe\r\n{auth}"
    return [
        Case(
            f"{prefix}non-numeric Content-Length",
            f"{head}Content-Length: abc\r\n\r\n{{}}".encode(),
            (400,),
            target,
        ),
        Case(
            f"{prefix}two Content-Lengths",
            f"{head}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}".encode(),
            (400,),
            target,
        ),
        Case(
            f"{prefix}4 MB header",
            b"GET /health HTTP/1.1\r\nHost: probe\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n",
            (431,),
            target,
        ),
        Case(
            f"{prefix}header line without a colon",
            b"GET /health HTTP/1.1\r\nHost probe\r\n\r\n",
            (400,),
            target,
        ),
        Case(
            f"{prefix}TLS hello on the plain port",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03",
            (400,),
            target,
        ),
        Case(
            f"{prefix}chunked upload over the limit",
            chunked("/generate", 2 << 20, key),
            (413,),
            target,
        ),
    ]


def auth_cases(key: str) -> list[Case]:
    """Every guarded route without a key, with a wrong one and with another scheme (401);
    the open probes without a key and a guarded route with the key (200)."""
    guarded = [
        ("GET", "/v1/models", None),
        ("GET", "/backends", None),
        ("GET", "/openapi.json", None),
        ("GET", "/docs", None),
        ("POST", "/generate", {"prompt": "a", "model": MODEL}),
        ("POST", "/v1/completions", {"prompt": "a", "model": MODEL}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}]},
        ),
        ("POST", "/v2/models/ensemble/generate", {"text_input": "a"}),
    ]
    cases = []
    for method, path, body in guarded:
        cases.append(Case(f"{path} without a key", request(method, path, body), (401,)))
        cases.append(Case(f"{path} wrong key", request(method, path, body, key="wrong"), (401,)))
        cases.append(
            Case(
                f"{path} Basic auth",
                request(method, path, body, headers={"Authorization": "Basic cHJvYmU6cHJvYmU="}),
                (401,),
            )
        )
    for path in ("/health", "/metrics", "/v2/health/ready", "/v2/health/live"):
        cases.append(Case(f"{path} open", request("GET", path), (200,)))
    cases.append(Case("/v1/models with the key", request("GET", "/v1/models", key=key), (200,)))
    return cases


@dataclass
class Tally:
    """The counts of one kind of probe."""

    kind: str
    cases: int = 0
    correct: int = 0
    server_errors: int = 0
    hangs: int = 0
    collateral: int = 0
    secrets: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # correct, but worth a word (refusals)

    def add(self, name: str, status: int | None, correct: bool) -> None:
        """Count one case: ``status`` None means no answer within the timeout (a hang)."""
        self.cases += 1
        self.correct += correct
        self.hangs += status is None
        self.server_errors += status is not None and status >= 500 and not correct
        if not correct:
            self.failures.append(f"{name}: {status}")
