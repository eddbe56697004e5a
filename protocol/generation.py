"""Native API models: ``POST /generate`` requests, answers and stream chunks.

Decoding parameters use Hugging Face ``generate`` names so that a config written for
transformers means the same thing here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from protocol.logit_bias import parse_logit_bias
from protocol.resume import StreamResume
from protocol.structured_outputs import GrammarKind, StructuredOutputs


def _check_truncation(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be -1 (the model's maximum) or a positive number of tokens")
    return value


#: vLLM's ``truncate_prompt_tokens``: keep an input's last N tokens (-1: the model's maximum).
TruncatePromptTokens = Annotated[int | None, Field(ge=-1), AfterValidator(_check_truncation)]

FinishReason = Literal["stop", "length", "abort"]

MAX_STOP_STRINGS = 16
#: The most ``bad_words`` a request may ban (each costs a check per step).
MAX_BAD_WORDS = 128
#: Below this temperature, sampling is greedy decoding (as in vLLM): dividing logits by a
#: vanishing temperature overflows them to inf/NaN and samples garbage, or nothing.
MIN_SAMPLING_TEMPERATURE = 1e-5
#: The most alternatives a token's logprobs may list (OpenAI's chat ``top_logprobs`` bound).
MAX_TOP_LOGPROBS = 20
#: What a logprob that is -inf (a token the processing removed) is written as: JSON has no
#: infinity, and OpenAI and vLLM write -9999.0.
MIN_LOGPROB = -9999.0

#: The knobs that change a greedy argmax and that beam search does not take (see
#: ``GenerationConfig``), each with its "unused" value.
ADDITIVE_KNOBS: dict[str, object] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
}


class GenerationConfig(BaseModel):
    """Per-request decoding parameters (Hugging Face names and meanings).

    ``max_new_tokens`` left unset means "as many as the server's default allows".
    A ``temperature`` below ``MIN_SAMPLING_TEMPERATURE`` (0 included) with ``do_sample`` is
    treated as greedy decoding, as OpenAI and vLLM do.

    Beside Hugging Face's knobs, OpenAI's and vLLM's, with their definitions (token counts are
    of the generated tokens only, never the prompt's):

    - ``allowed_token_ids`` (vLLM's): every other token's logit is -inf, first;
    - ``bad_words`` (vLLM's): a word's last token is -inf when the output ends with the rest of
      its tokens (each word as written and after a space; ``server.common.bad_words``);
    - ``logit_bias`` ``{token id: b}``: ``logits[t] += b``, on the raw logits;
    - ``frequency_penalty`` f and ``presence_penalty`` p (-2..2): ``logits[t] -= f *
      count(t) + p * (count(t) > 0)``, before the temperature;
    - ``min_p`` (0..1, sampling only): after the temperature, tokens whose probability is
      below ``min_p`` times the likeliest token's are dropped.

    The bias and the penalties change the greedy choice too; beam search refuses them.

    ``json_schema`` constrains the output to JSON that validates against the schema
    (``{"type": "object"}``: any JSON object), token by token (structured output); a schema
    the grammar library cannot compile is a 400. ``structured_outputs`` (vLLM's; not with
    ``json_schema``) constrains it to a schema, a regex, a choice, a grammar or a structural
    tag instead. Beam search refuses both.

    ``logprobs`` N (0..20) asks for each generated token's log-probability and its N likeliest
    alternatives, in float32 from the model's logits: of the raw logits by default
    (``logprobs_mode`` ``"raw"``, vLLM's ``raw_logprobs``), or of the scores the token was
    chosen from (``"processed"``: after ``logit_bias``, the penalties and, when sampling, the
    temperature and the filters; vLLM's ``processed_logprobs``). Beam search refuses it.

    ``prompt_logprobs`` N (0..20) asks for the same of the prompt's tokens, from the raw logits:
    each prompt token after the first, its logprob given the tokens before it, with its N
    likeliest alternatives (what ``echo`` with ``logprobs`` on /v1/completions shows, and what
    evaluation harnesses score with). A request that asks is never served from the prefix
    cache: every prompt position must go through the model.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    do_sample: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k filtering")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="0 disables min-p filtering")
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="token id -> bias added to its logit (-100..100)"
    )
    allowed_token_ids: list[int] | None = Field(
        default=None, min_length=1, description="only these token ids may be generated"
    )
    bad_words: list[str] = Field(
        default_factory=list,
        max_length=MAX_BAD_WORDS,
        description="words the output must not contain (vLLM's: banned token by token)",
    )
    num_beams: int = Field(default=1, ge=1, le=64)
    num_return_sequences: int = Field(default=1, ge=1, le=64)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(
        default=False, description="keep the matched stop string at the end of the text"
    )
    skip_special_tokens: bool = Field(
        default=True, description="false: special tokens' text is part of the output"
    )
    ignore_eos: bool = False
    priority: int = Field(
        default=0,
        description="among waiting requests a lower value is admitted first (vLLM's priority; "
        "the continuous-batching server)",
    )
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    json_schema: dict[str, Any] | None = Field(
        default=None, description="constrain the output to JSON valid against this schema"
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="vLLM's structured outputs: a JSON schema, a regex, a choice, a grammar or "
        "a structural tag (one; not with json_schema)",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="None: no logprobs; N: each token's logprob and its N likeliest alternatives",
    )
    logprobs_mode: Literal["raw", "processed"] = "raw"
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="None: none; N: each prompt token's logprob (after the first) and its N "
        "likeliest alternatives, of the raw logits",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _parse_logit_bias(cls, value: Any) -> Any:
        return parse_logit_bias(value)

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str]) -> list[str]:
        if any(not word.strip() for word in value):
            raise ValueError("bad words must not be empty or blank")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> GenerationConfig:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.json_schema is not None and self.structured_outputs is not None:
            raise ValueError("'json_schema' and 'structured_outputs' cannot both be given")
        if self.do_sample and self.temperature < MIN_SAMPLING_TEMPERATURE:
            # OpenAI semantics: temperature 0 is greedy (and so is one too small to divide by).
            self.do_sample = False
        if self.num_beams > 1:
            if self.do_sample:
                raise ValueError("beam search with do_sample (beam sampling) is not supported")
            # Beam scores are log-probs; additive logit knobs have no agreed meaning there.
            for name, unused in ADDITIVE_KNOBS.items():
                if getattr(self, name) != unused:
                    raise ValueError(f"'{name}' is not supported with beam search")
            if self.allowed_token_ids is not None:
                raise ValueError("'allowed_token_ids' is not supported with beam search")
            if self.bad_words:
                raise ValueError("'bad_words' is not supported with beam search")
            if self.json_schema is not None or self.structured_outputs is not None:
                raise ValueError("structured output is not supported with beam search")
            if self.logprobs is not None:
                # A beam's tokens are chosen by the beams' running scores, not one by one.
                raise ValueError("'logprobs' is not supported with beam search")
            if self.num_return_sequences > self.num_beams:
                raise ValueError(
                    f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                    f"({self.num_beams}) when beam searching"
                )
        elif self.num_return_sequences > 1 and not self.do_sample:
            raise ValueError(
                "num_return_sequences > 1 needs do_sample=true or num_beams >= "
                "num_return_sequences (greedy decoding would return identical copies)"
            )
        return self

    @property
    def output_grammar(self) -> tuple[GrammarKind, str] | None:
        """The output's constraint as (kind, text) for the grammar compiler; None: free."""
        if self.json_schema is not None:
            return "json", json.dumps(self.json_schema)
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_source()
        return None

    @property
    def is_beam_search(self) -> bool:
        """True when this request decodes with beam search."""
        return self.num_beams > 1

    @property
    def num_workload_beams(self) -> int:
        """How many sequences this request decodes at once (its share of a batch)."""
        return max(self.num_beams, self.num_return_sequences)


class TextContentPart(BaseModel):
    """An OpenAI-style content part; only text parts are served."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation, rendered with the model's chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerateRequest(BaseModel):
    """Body of ``POST /generate``: exactly one of ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    generation_config: GenerationConfig = Field(default_factory=GenerationConfig)
    stream: bool = False
    #: Set by our gateway only: finish a stream another server broke off (``protocol.resume``).
    resume: StreamResume | None = None

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self

    def to_generate_request(self) -> GenerateRequest:
        """Itself: the native form of a native request (OpenAI requests have the same method)."""
        return self


class Usage(BaseModel):
    """Token counts of one request, under OpenAI's names: the native and the OpenAI-compatible
    answers (and the chat UI reading them) share this one model."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    """One of a token's likeliest alternatives (the token itself may be among them)."""

    token_id: int
    #: The token's text alone (``tokenizer.decode([token_id])``).
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log-probability (float32, ``MIN_LOGPROB`` for -inf) and its
    ``generation_config.logprobs`` likeliest alternatives, best first."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Choice(BaseModel):
    """One generated sequence (``logprobs``: one entry per generated token, stop ids included,
    when ``generation_config.logprobs`` is set; a stream chunk's are its new tokens')."""

    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    #: With ``generation_config.prompt_logprobs``: one entry per prompt token after the first
    #: (the first has nothing before it), on the choice's first chunk of a stream.
    prompt_logprobs: list[TokenLogprob] | None = None


class GenerateResponse(BaseModel):
    """Answer of ``POST /generate`` (non-streaming)."""

    id: str
    model: str
    choices: list[Choice]
    usage: Usage


class GenerateStreamChunk(BaseModel):
    """One Server-Sent Event of a streaming ``/generate``: text deltas per choice.

    The last chunk before ``[DONE]`` carries ``usage``.
    """

    id: str
    model: str
    choices: list[Choice]
    usage: Usage | None = None
