"""Request bodies of the OpenAI-compatible API: completions and chat completions.

They accept the fields the official ``openai`` SDK sends and the common extras of vLLM's server
(``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``use_beam_search``, ``best_of``...). ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` and ``min_p`` keep OpenAI's and vLLM's definitions (see
``protocol.generation.GenerationConfig``). A known field whose value we cannot honour
(``suffix``, ``best_of`` above ``n`` without beam search) is refused with a clear message.
Fields we do not know at all are kept aside (``unknown_fields``), never read: the servers refuse
them with a 400 naming them, or with ``serving_config.unknown_fields: warn`` answer with a
warning (``server.common.field_policy``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol.generation import (
    MAX_TOP_LOGPROBS,
    MIN_SAMPLING_TEMPERATURE,
    ChatMessage,
    GenerateRequest,
    GenerationConfig,
    TruncatePromptTokens,
    parse_logit_bias,
)
from protocol.openai_api.request_parts import (
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
)
from protocol.resume import StreamResume
from protocol.structured_outputs import StructuredOutputs, one_constraint

#: vLLM's older names of ``structured_outputs``' constraints: ``guided_<name>`` is
#: ``structured_outputs: {<name>: ...}`` (``structural_tag`` keeps its name).
GUIDED_FIELDS = ("json", "regex", "choice", "grammar")
#: The ``guided_decoding_backend`` values this server takes: its grammar library is llguidance.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")

#: The bound of the completions ``logprobs`` (alternatives per token): vLLM's 20, where
#: OpenAI's legacy API stops at 5.
MAX_COMPLETION_LOGPROBS = MAX_TOP_LOGPROBS


class _SamplingFields(BaseModel):
    """Decoding fields shared by completions and chat completions.

    Fields not declared here are kept aside (``extra="allow"``) and never read; the servers'
    field policy refuses or reports them (``unknown_fields``).
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # JSON keys are strings ("50256"); parsed to token ids, values checked against -100..100.
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    #: vLLM's: only these token ids may be generated.
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    #: vLLM's: words the output must not contain.
    bad_words: list[str] | None = None
    # vLLM-style extras.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: vLLM's: among waiting requests a lower value is admitted first.
    priority: int = 0
    #: vLLM's: keep only the prompt's last N tokens (-1: the last ``max_model_len``).
    truncate_prompt_tokens: TruncatePromptTokens = None
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1, le=64)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    response_format: ResponseFormat | None = None
    #: vLLM's: the output follows a JSON schema, a regex, a choice, a grammar or a tag.
    structured_outputs: StructuredOutputs | None = None
    #: vLLM's older names for ``structured_outputs``' json, regex, choice and grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: vLLM's top-level structural tag (``structured_outputs.structural_tag``'s older name).
    structural_tag: str | None = None
    #: vLLM's choice of grammar library: this server's is llguidance (``auto`` takes it).
    guided_decoding_backend: str | None = None
    #: vLLM's: True is how special tokens are shown here; False is refused.
    spaces_between_special_tokens: bool = True
    #: vLLM's: add the tokenizer's special tokens (BOS) when encoding the prompt; None: yes
    #: for completions, no for chat (the template writes them).
    add_special_tokens: bool | None = None
    #: vLLM's: answer with the prompt's and the output's token ids beside the text.
    return_token_ids: bool = False
    #: vLLM's: each prompt token's logprob (after the first) and this many alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    #: vLLM's logprobs mode as an extra: "raw" (default) or "processed" (see GenerationConfig).
    logprobs_mode: Literal["raw", "processed"] | None = None
    #: Set by our gateway only: finish a stream another server broke off (``protocol.resume``).
    resume: StreamResume | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _parse_logit_bias(cls, value: Any) -> Any:
        return None if value is None else parse_logit_bias(value)

    @field_validator("guided_decoding_backend")
    @classmethod
    def _llguidance_only(cls, value: str | None) -> str | None:
        if value not in (None, *GRAMMAR_BACKENDS):
            raise ValueError(
                f"'guided_decoding_backend' {value!r} is not available: this server's grammar "
                "library is llguidance ('auto', 'guidance' or 'llguidance')"
            )
        return value

    @property
    def unknown_fields(self) -> list[str]:
        """The body's fields this API does not declare (none of them is read), sorted; those
        inside ``stream_options`` as ``stream_options.<name>``."""
        names = list(self.model_extra or {})
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in self.stream_options.model_extra or {}]
        return sorted(names)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        if self.best_of is not None and self.best_of > self.n and not self.use_beam_search:
            raise ValueError("'best_of' > 'n' is only supported with 'use_beam_search'")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("'prompt_logprobs' is not available with 'stream' (as in vLLM)")
        self._fold_guided_fields()
        return self

    def _fold_guided_fields(self) -> None:
        """Turn a ``guided_*`` field into ``structured_outputs``; refuse two constraints."""
        if not self.spaces_between_special_tokens:
            raise ValueError(
                "'spaces_between_special_tokens': false is not supported (special tokens are "
                "shown as the tokenizer decodes them)"
            )
        older = {f"guided_{name}": getattr(self, f"guided_{name}") for name in GUIDED_FIELDS}
        older["structural_tag"] = self.structural_tag
        has_format = self.response_format is not None and self.response_format.type != "text"
        self.structured_outputs = one_constraint(self.structured_outputs, older, has_format)

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_top_logprobs(self) -> int | None:
        """The native ``logprobs``: None for none, else the number of alternatives."""
        raise NotImplementedError

    def _num_prompt_logprobs(self) -> int | None:
        """The native ``prompt_logprobs``: None unless the API asks for the prompt's."""
        return self.prompt_logprobs

    def to_generation_config(self) -> GenerationConfig:
        """Translate OpenAI/vLLM fields into our Hugging Face-named config.

        Raises ``ValueError`` (with the field named) when the combination is invalid.
        """
        temperature = 1.0 if self.temperature is None else self.temperature
        num_beams = 1
        if self.use_beam_search:
            num_beams = max(self.best_of or self.n, self.n)
        do_sample = num_beams == 1 and temperature >= MIN_SAMPLING_TEMPERATURE
        return GenerationConfig(
            max_new_tokens=self._max_tokens(),
            min_new_tokens=self.min_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            typical_p=1.0 if self.typical_p is None else self.typical_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias or {},
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or [],
            num_beams=num_beams,
            num_return_sequences=self.n,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            seed=self.seed,
            json_schema=self.response_format.schema_of_output() if self.response_format else None,
            structured_outputs=self.structured_outputs,
            logprobs=self._num_top_logprobs(),
            logprobs_mode=self.logprobs_mode or "raw",
            prompt_logprobs=self._num_prompt_logprobs(),
        )

    def _native(self, **inputs: Any) -> GenerateRequest | None:
        """The native request with ``inputs`` (prompt or messages) and this request's options;
        None when the options make no valid native config."""
        try:
            config = self.to_generation_config()
            return GenerateRequest(
                model=self.model, generation_config=config, stream=self.stream, **inputs
            )
        except (ValueError, ValidationError):
            return None

    @property
    def is_usage_streamed(self) -> bool:
        """True when the last stream chunk must carry usage."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    #: 0 only with ``echo``: the prompt (and its logprobs) alone, nothing generated.
    max_tokens: int | None = Field(default=16, ge=0)
    #: Answer with the prompt before the completion; with ``logprobs``, the prompt's tokens'
    #: logprobs come first too (the first token's is null), as OpenAI's legacy API and vLLM do.
    echo: bool = False
    #: OpenAI's: each token's logprob and this many likeliest alternatives (0..5).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion_fields(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("'suffix' is not supported")
        if (
            self.echo
            and self.logprobs is not None
            and self.prompt_logprobs not in (None, self.logprobs)
        ):
            raise ValueError(
                "'prompt_logprobs' must equal 'logprobs' when 'echo' scores the prompt too"
            )
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("'max_tokens' must be at least 1 (0 only with 'echo')")
        return self

    @property
    def is_echo_only(self) -> bool:
        """True for ``echo`` with ``max_tokens`` 0: the answer is the prompt alone."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        # The engine always runs one step past the prompt; an echo-only answer drops its token.
        return 1 if self.is_echo_only else self.max_tokens

    def _num_top_logprobs(self) -> int | None:
        return self.logprobs

    def _num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list per prompt."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def to_generate_request(self) -> GenerateRequest | None:
        """The native request that asks the same, or None when none does (several prompts,
        token-id prompts, ``echo``, or options that make no valid native config)."""
        prompts = self.prompts()
        if len(prompts) != 1 or not isinstance(prompts[0], str) or self.echo:
            return None
        return self._native(prompt=prompts[0])


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: documents for a template that does retrieval-augmented generation.
    documents: list[dict[str, str]] | None = None
    #: OpenAI's: how hard a reasoning model thinks; given to the chat template as
    #: ``reasoning_effort`` (templates that read it, gpt-oss's say, act on it).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    #: vLLM's: false leaves the split-out reasoning out of the answer.
    include_reasoning: bool = True

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template is given beside the messages: ``chat_template_kwargs``,
        ``reasoning_effort`` and ``documents``."""
        extra: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
        if self.documents is not None:
            extra["documents"] = self.documents
        if not extra:
            return self.chat_template_kwargs
        return {**extra, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, which is "
                    f"not among the tools ({', '.join(names) or 'none given'})"
                )
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs 'tools'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true"
            )
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def active_tools(self) -> list[dict[str, Any]]:
        """The tools the model is told about (none with ``tool_choice: "none"``), as dicts."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def forced_function(self) -> str | None:
        """With ``tool_choice`` required or a named function: "" (any) or the name; else None
        (the model decides, or there are no tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" and self.tools else None

    def to_generate_request(self) -> GenerateRequest | None:
        """The native request that asks the same, or None when none does (a continued final
        message, chat template arguments, or options that make no valid native config)."""
        if self.continue_final_message or self.template_kwargs or self.active_tools:
            return None
        return self._native(messages=self.messages)
