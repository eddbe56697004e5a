"""What an OpenAI request's undeclared fields get (``serving_config.unknown_fields``).

OpenAI's API answers an argument it does not know with a 400; a server that silently dropped
vLLM's ``guided_json`` or ``skip_special_tokens`` would answer something the caller did not
ask for. So by default (``reject``) every such field is refused by name. ``warn`` is for
deployments whose clients send extras they can live without: the request is answered without
them, the log says which were dropped, and so does the ``X-Unknown-Fields`` response header.
"""

from __future__ import annotations

import logging

from fastapi.responses import Response

from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from server.common.config import UnknownFieldsPolicy
from utils.errors import APIError

logger = logging.getLogger(__name__)

#: The response header that names the fields a ``warn`` server answered without.
UNKNOWN_FIELDS_HEADER = "X-Unknown-Fields"


def check_unknown_fields(
    body: CompletionRequest | ChatCompletionRequest, policy: UnknownFieldsPolicy, route: str
) -> list[str]:
    """The body's unknown fields (empty: none); raises the 400 when ``policy`` rejects them."""
    unknown = body.unknown_fields
    if not unknown:
        return []
    names = ", ".join(f"'{name}'" for name in unknown)
    if policy == "reject":
        noun, it = ("field", "it") if len(unknown) == 1 else ("fields", "them")
        raise APIError(
            400,
            f"unknown {noun} {names} for {route}: this server does not honour {it} (remove "
            f"{it}, or start the server with serving_config.unknown_fields: warn to have such "
            "fields dropped)",
            param=unknown[0],
        )
    logger.warning("%s: answered without the unknown fields %s", route, names)
    return unknown


def mark_dropped(response: Response, dropped: list[str]) -> Response:
    """Name the dropped fields in ``response``'s ``X-Unknown-Fields`` header."""
    if dropped:
        response.headers[UNKNOWN_FIELDS_HEADER] = ", ".join(dropped)
    return response
