"""Stored Responses API answers (``store: true``, the API's default): each answer's object, for
``GET /v1/responses/{id}``, and its whole conversation, which a later request continues with
``previous_response_id``. Bounded and in memory: the oldest answers are forgotten first, and
a restart forgets them all (a request naming a forgotten one answers 404)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: How many answers a server keeps by default.
DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    """One stored answer: the response object, and the chat messages of the conversation up
    to and including it (without the instructions, which do not carry over)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The last ``max_responses`` stored answers, by id (least recently used forgotten)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep ``entry`` under ``response_id``, forgetting the oldest past the bound."""
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored answer, or None when it was never stored or is forgotten."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def __len__(self) -> int:
        return len(self._entries)
