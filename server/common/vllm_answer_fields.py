"""vLLM's answer fields beside OpenAI's: ``return_token_ids`` and ``prompt_logprobs``.

``return_token_ids``. Completions: each choice carries its ``prompt_token_ids`` and
``token_ids``. Chat: the answer carries the rendered chat's ``prompt_token_ids``, each choice
its ``token_ids``. Streamed, the prompt's ids come with the first event that shows the choice
(completions) or the first event (chat, top level), and each event carries the ids generated
since the choice's last event; an event a shape holds back (text not yet decodable, tool calls
read at the end) keeps its ids for the next one, so the stream's ids add up to the whole
output's.

``prompt_logprobs`` N (whole answers only, as vLLM): per prompt token, None for the first, then
``{token id: {logprob, rank, decoded_token}}`` of the token itself and its N likeliest
alternatives; on each completion choice, at the top of a chat answer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import BaseModel

from protocol.generation import TokenLogprob
from protocol.openai_api import PromptLogprob
from server.common.answers import AnswerShape
from server.common.backend import TextDelta
from server.common.service import ChoiceResult, Job


def with_token_ids(shape: AnswerShape, job: Job, *, is_chat: bool) -> AnswerShape:
    """``shape`` with the prompt's and the output's token ids added (vLLM's places)."""
    pending: dict[int, list[int]] = {}
    # echo with max_tokens 0: the one token the engine ran is not part of the answer.
    is_dropped = job.is_output_dropped

    def chunk_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
        ids = pending.setdefault(delta.index, [])
        if not is_dropped:
            ids.extend(delta.token_ids)
        choice = shape.chunk_choice(delta, is_opening)
        if choice is None:
            return None
        choice["token_ids"] = pending.pop(delta.index)
        if is_opening and not is_chat:
            choice["prompt_token_ids"] = job.prompt_token_ids_of(delta.index)
        return choice

    def response_choice(result: ChoiceResult) -> BaseModel:
        update: dict[str, Any] = {"token_ids": [] if is_dropped else result.token_ids}
        if not is_chat:
            update["prompt_token_ids"] = job.prompt_token_ids_of(result.index)
        return shape.response_choice(result).model_copy(update=update)

    if not is_chat:
        return dataclasses.replace(
            shape, chunk_choice=chunk_choice, response_choice=response_choice
        )
    prompt = {"prompt_token_ids": job.prompt_token_ids_of(0)}
    return dataclasses.replace(
        shape,
        chunk_choice=chunk_choice,
        response_choice=response_choice,
        response=functools.partial(shape.response, **prompt),
        opening_fields=prompt,
    )


def vllm_prompt_logprobs(entries: list[TokenLogprob]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt's entries (one per token after the first):
    ``rank`` is an alternative's place, the prompt token's own where it is among them."""
    scored: list[dict[str, PromptLogprob] | None] = [None]
    for entry in entries:
        ranks = {top.token_id: place for place, top in enumerate(entry.top_logprobs, start=1)}
        position = {
            str(entry.token_id): PromptLogprob(
                logprob=entry.logprob, rank=ranks.get(entry.token_id), decoded_token=entry.token
            )
        }
        for top in entry.top_logprobs:
            position.setdefault(
                str(top.token_id),
                PromptLogprob(
                    logprob=top.logprob, rank=ranks[top.token_id], decoded_token=top.token
                ),
            )
        scored.append(position)
    return scored


def with_prompt_logprobs(shape: AnswerShape, *, is_chat: bool) -> AnswerShape:
    """``shape`` (a whole answer's) with vLLM's ``prompt_logprobs``."""
    seen: list[list[TokenLogprob]] = []

    def response_choice(result: ChoiceResult) -> BaseModel:
        answer = shape.response_choice(result)
        entries = result.prompt_logprobs or []
        if is_chat:
            seen.append(entries)  # the answer's top level takes them (one prompt)
            return answer
        return answer.model_copy(update={"prompt_logprobs": vllm_prompt_logprobs(entries)})

    def response(**fields: Any) -> BaseModel:
        # Called after every choice was built: the choices' results have been seen.
        return shape.response(
            **fields, prompt_logprobs=vllm_prompt_logprobs(seen[0] if seen else [])
        )

    if not is_chat:
        return dataclasses.replace(shape, response_choice=response_choice)
    return dataclasses.replace(shape, response_choice=response_choice, response=response)
