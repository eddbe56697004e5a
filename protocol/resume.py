"""Resumable streams: what our servers tell the gateway while they stream, and what the gateway
sends another server to finish a stream whose server died.

A gateway that sends ``STREAM_TOKENS_HEADER: 1`` with a streamed request gets, inside the
Server-Sent Events, comment lines that every SSE client ignores (``:`` lines; the gateway also
strips them before relaying, so callers never see them):

- ``: stream {"id", "created", "prompt_token_ids"}`` once, before any token, when the stream
  can be resumed (one prompt, no beam search, no tool parsing, no echo);
- ``: tokens {"<choice index>": [[token ids], <characters of text>], ...}`` on each event
  whose step produced tokens or text: the token ids of the step per choice and how many
  characters of text the same event carries for that choice (the text a detokenizer holds
  back is counted when it is sent).

If the stream breaks, the gateway sends the same request to another server with ``resume``
(a :class:`StreamResume`): the prompt's ids, and, per unfinished choice, the ids streamed and
the characters of text the caller received. The new server continues each choice as if it had
generated those tokens itself (budget, ``min_tokens``, penalties, stop strings that straddle
the switch, the seeded draws of :mod:`protocol.draw_keys`) and streams only what is new, in
the same shape, under the same response id, counting the earlier tokens in its usage.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The request header that asks a server for the comment lines (value ``1``).
STREAM_TOKENS_HEADER = "x-stream-token-ids"
#: The comment line that opens a resumable stream.
STREAM_COMMENT = b": stream "
#: The comment line with an event's token ids.
TOKENS_COMMENT = b": tokens "


class ResumedChoice(BaseModel):
    """One unfinished choice of a broken stream."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    #: The ids the dead server streamed for this choice, in order.
    token_ids: list[int] = Field(default_factory=list)
    #: Characters of this choice's text that reached the caller (the rest is held back).
    num_text_chars: int = Field(default=0, ge=0)


class StreamResume(BaseModel):
    """Body field ``resume`` (native, completions and chat): finish these choices."""

    model_config = ConfigDict(extra="forbid")

    #: The answer's id and creation time, kept so that the caller sees one answer.
    response_id: str = Field(min_length=1, max_length=200)
    created: int | None = None
    prompt_token_ids: list[int] = Field(min_length=1)
    choices: list[ResumedChoice] = Field(min_length=1)
    #: Completion tokens the caller already got (finished choices included): usage counts them.
    num_completion_tokens: int = Field(default=0, ge=0)
