"""Which server holds each Responses API answer the gateway relayed, so that a request naming
it (``previous_response_id``) goes back there: each server keeps its own stored answers
(``server.common.responses_store``). Bounded and in memory, the oldest forgotten first."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING

from client.endpoints import Endpoint

if TYPE_CHECKING:
    from client.gateway_request import GatewayRequest

#: A response's id in the head of its answer (the whole JSON, or the ``response.created`` event).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')
#: How many answers' homes are kept.
MAX_HOMES = 10_000


class ResponseHomes:
    """Response id -> the name of the backend that answered it."""

    def __init__(self, max_homes: int = MAX_HOMES) -> None:
        self.max_homes = max_homes
        self._homes: OrderedDict[str, str] = OrderedDict()

    def learn(self, request: GatewayRequest, backend_name: str, answer_head: bytes) -> None:
        """Remember where a Responses API answer came from (its id read from ``answer_head``:
        the whole answer, or a stream's first bytes)."""
        if request.endpoint != Endpoint.RESPONSES:
            return
        match = _RESPONSE_ID.search(answer_head)
        if match is None:
            return
        self._homes[match.group(1).decode()] = backend_name
        while len(self._homes) > self.max_homes:
            self._homes.popitem(last=False)

    def home_of(self, request: GatewayRequest) -> str | None:
        """The backend holding the answer ``request`` continues (None: none known)."""
        if request.endpoint != Endpoint.RESPONSES:
            return None
        previous = (getattr(request.parsed, "model_extra", None) or {}).get("previous_response_id")
        return self._homes.get(previous) if isinstance(previous, str) else None
