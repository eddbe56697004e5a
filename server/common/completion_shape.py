"""How /v1/completions words an answer: each choice's text and OpenAI's legacy ``logprobs``
(tokens, their logprobs, their likeliest alternatives and their offsets in the text), with
``echo``: the prompt first, and with ``logprobs`` its tokens' logprobs first (the first
token's is null: nothing comes before it), as OpenAI's legacy API and vLLM answer.

``echo`` with ``max_tokens`` 0 answers with the prompt alone: the engine still runs one
step (it always samples after the prompt), and its token is dropped here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.generation import TokenLogprob
from protocol.openai_api import CompletionChoice, CompletionLogprobs, CompletionResponse
from server.common.answers import AnswerShape
from server.common.backend import TextDelta
from server.common.service import ChoiceResult


@dataclass(frozen=True)
class EchoedPrompt:
    """What ``echo`` puts before a prompt's completions."""

    #: The prompt as the caller wrote it (decoded, for a token-id prompt).
    text: str
    #: The text of the prompt's first token (its logprobs entry has no value).
    first_token: str


@dataclass(frozen=True)
class Echo:
    """A request's ``echo``: its prompts in order (choice i*n+j belongs to prompt i)."""

    prompts: list[EchoedPrompt]
    num_choices_per_prompt: int
    #: ``max_tokens`` 0: the generated token is dropped, only the prompt is answered.
    is_prompt_only: bool = False

    def prompt_of(self, index: int) -> EchoedPrompt:
        """The prompt that choice ``index`` continues."""
        return self.prompts[index // self.num_choices_per_prompt]


def completion_logprobs(
    entries: list[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` (``CompletionLogprobs``) of these tokens, the first
    at ``offset`` in the choice's text (each token's offset adds the texts before it)."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(prompt: EchoedPrompt, entries: list[TokenLogprob]) -> dict[str, Any]:
    """The echoed prompt's ``logprobs``: its first token with nulls, then ``entries`` (one
    per prompt token after the first), offsets from the start of the text."""
    scored = completion_logprobs(entries, len(prompt.first_token))
    assert scored is not None
    return {
        "tokens": [prompt.first_token, *scored["tokens"]],
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *scored["text_offset"]],
    }


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two ``logprobs`` objects one after the other (either may be None)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def completion_shape(echo: Echo | None = None) -> AnswerShape:
    """The completions shape of one request (its stream keeps each choice's text offset)."""
    offsets: dict[int, int] = {}

    def prompt_part(index: int, entries: list[TokenLogprob] | None) -> tuple[str, Any]:
        """The echoed text and logprobs that open choice ``index`` ("" and None: no echo)."""
        if echo is None:
            return "", None
        prompt = echo.prompt_of(index)
        return prompt.text, None if entries is None else prompt_logprobs(prompt, entries)

    def chunk_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
        """A choice's part of a completion stream chunk (a ``CompletionChoice``), when it has
        news (text, its end, new tokens' logprobs, or, opening it, the echoed prompt)."""
        text, entries = delta.text, delta.logprobs
        finish_reason = delta.finish_reason
        if echo is not None and echo.is_prompt_only:
            text, entries = "", None
            finish_reason = "length" if finish_reason is not None else None
        head_text, head_logprobs = prompt_part(delta.index, delta.prompt_logprobs)
        if not is_opening:
            head_text, head_logprobs = "", None
        if not (head_text or text or entries or head_logprobs) and finish_reason is None:
            return None
        offset = offsets.get(delta.index, len(head_text))
        logprobs = completion_logprobs(entries, offset)
        if entries:
            offset += sum(len(e.token) for e in entries)
        offsets[delta.index] = offset
        return {
            "index": delta.index,
            "text": head_text + text,
            "finish_reason": finish_reason,
            "logprobs": _joined(head_logprobs, logprobs),
        }

    def response_choice(r: ChoiceResult) -> CompletionChoice:
        text, entries, finish_reason = r.text, r.logprobs, r.finish_reason
        if echo is not None and echo.is_prompt_only:
            text, entries, finish_reason = "", None, "length"
        head_text, head_logprobs = prompt_part(r.index, r.prompt_logprobs)
        logprobs = _joined(head_logprobs, completion_logprobs(entries, len(head_text)))
        return CompletionChoice(
            index=r.index,
            text=head_text + text,
            finish_reason=finish_reason,
            logprobs=None if logprobs is None else CompletionLogprobs.model_validate(logprobs),
        )

    return AnswerShape(
        chunk=CompletionResponse,
        chunk_choice=chunk_choice,
        response=CompletionResponse,
        response_choice=response_choice,
        is_resumable=echo is None,
    )
