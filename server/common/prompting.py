"""Turning API inputs into token ids: chat templates, tokenization and context-length checks."""

from __future__ import annotations

from typing import Any

from protocol.generation import ChatMessage, GenerationConfig
from server.common.tool_calls import fallback_conversation
from utils.chat_template import ChatTemplateError, conversation_of, render_conversation
from utils.errors import APIError


class PromptProcessor:
    """Renders chat messages, tokenizes prompts and resolves ``max_new_tokens``.

    Every refusal is an ``APIError(400)`` whose message gives the numbers involved.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, default_max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.default_max_new_tokens = default_max_new_tokens

    def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template into one prompt string.

        ``tools`` go to the template; a template that ignores them (it renders the same text
        with and without) gets ``server.common.tool_calls``' documented fallback instead.
        """
        conversation = conversation_of(messages)
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "template_kwargs": template_kwargs,
        }
        try:
            if not tools:
                return render_conversation(self.tokenizer, conversation, **options)
            with_tools = render_conversation(self.tokenizer, conversation, tools=tools, **options)
            if with_tools != render_conversation(self.tokenizer, conversation, **options):
                return with_tools
            return render_conversation(
                self.tokenizer, fallback_conversation(conversation, tools), **options
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages" if exc.is_missing else None) from exc

    def encode(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``prompt``, with the tokenizer's special tokens (BOS) unless told not to:
        a rendered chat prompt already holds its own."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids (-1: the last
        ``max_model_len``); None keeps them all."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def check_token_ids(self, token_ids: list[int], field: str = "prompt") -> list[int]:
        """Validate token ids a request gives (a prompt, stop tokens, ``logit_bias`` keys):
        each must be in the vocabulary, or the engine would index past its logits."""
        vocab_size = len(self.tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"{field} token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                param=field,
            )
        return token_ids

    def max_new_tokens_for(self, num_prompt_tokens: int, config: GenerationConfig) -> int:
        """``config.max_new_tokens``, or the default that fits; refuses what cannot fit."""
        if num_prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {num_prompt_tokens} tokens long but this model's context is "
                f"{self.max_model_len} tokens; shorten the prompt by at least {1 - room} tokens",
                param="prompt",
            )
        if config.max_new_tokens is None:
            max_new_tokens = min(self.default_max_new_tokens, room)
        elif config.max_new_tokens > room:
            raise APIError(
                400,
                f"the prompt ({num_prompt_tokens} tokens) plus max_new_tokens "
                f"({config.max_new_tokens}) exceeds this model's context of "
                f"{self.max_model_len} tokens; ask for at most {room} new tokens",
                param="max_new_tokens",
            )
        else:
            max_new_tokens = config.max_new_tokens
        if config.min_new_tokens > max_new_tokens:
            raise APIError(
                400,
                f"min_new_tokens ({config.min_new_tokens}) is more than the {max_new_tokens} "
                "new tokens that fit",
                param="min_new_tokens",
            )
        return max_new_tokens
