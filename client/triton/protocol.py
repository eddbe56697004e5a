"""Triton's ``generate`` API with TensorRT-LLM's fields: its requests, and their conversions
to and from native requests.

Triton Inference Server answers ``POST /v2/models/{model}/generate`` and ``.../generate_stream``
(its "generate extension") by turning each JSON field into the model input of the same name. A
Triton + TensorRT-LLM deployment serves the ``ensemble`` model, whose inputs are ``text_input``,
``max_tokens``, ``bad_words``, ``stop_words``, ``end_id``, ``pad_id``, ``top_k``, ``top_p``,
``temperature``, ``length_penalty``, ``repetition_penalty``, ``min_length``,
``presence_penalty``, ``frequency_penalty``, ``random_seed``, ``beam_width``, ``stream``,
``return_*`` flags and a few multimodal / LoRA / prompt-tuning tensors; its output is
``text_output`` (the generated text only, one string per returned beam).

Triton's answers, and native answers turned into them, are in ``client.triton.responses``.

Fields may also sit in the request's ``"parameters"`` object (Triton maps those to inputs too);
one given in both places is an error, as in Triton. Where Triton silently passes an unknown field
to the model as a request parameter, this contract refuses it, naming it, like every other API of
this suite: a field we cannot honour is never silently ignored.

Decoding follows TensorRT-LLM's rules: ``beam_width > 1`` is beam search; otherwise the request
samples when ``top_k > 1`` or ``top_p > 0`` (``top_k`` and ``top_p`` both 0, their defaults, mean
greedy, as does ``top_k == 1``) unless ``temperature`` is 0. ``temperature`` alone does not turn
sampling on.

``presence_penalty`` and ``frequency_penalty`` map to the native fields of the same names (the
same -2..2 range), which count generated tokens only (OpenAI's and vLLM's definition).
TensorRT-LLM's penalty kernel counts the prompt's tokens too unless its ``prompt_ignore_length``
covers the prompt: a Triton caller served by our servers gets the OpenAI meaning, and a native
request sent to a TensorRT-LLM server gets TensorRT-LLM's. The native ``logit_bias`` and
``min_p`` have no ensemble input, nor have ``logprobs`` and ``prompt_logprobs``: a request that
uses them is not sent to a Triton server.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.generation import MAX_STOP_STRINGS, GenerateRequest, GenerationConfig

#: TensorRT-LLM ensemble inputs (and Triton vLLM-backend fields) this suite cannot honour, with
#: what to say about each when a request sets it.
UNSUPPORTED_INPUTS: dict[str, str] = {
    "decoder_text_input": "encoder-decoder models are not served",
    "image_input": "multimodal inputs are not supported",
    "prompt_embedding_table": "prompt tuning is not supported",
    "prompt_vocab_size": "prompt tuning is not supported",
    "embedding_bias_words": "embedding bias is not supported",
    "embedding_bias_weights": "embedding bias is not supported",
    "lora_task_id": "LoRA adapters are not supported",
    "lora_weights": "LoRA adapters are not supported",
    "lora_config": "LoRA adapters are not supported",
    "sampling_parameters": (
        "it is the input of Triton's vLLM backend; send TensorRT-LLM's fields instead "
        "(max_tokens, temperature, top_p, top_k, stop_words, ...)"
    ),
}

#: Fields whose value is one scalar; Triton also takes them as a one-element list.
_SCALAR_FIELDS = (
    "text_input",
    "max_tokens",
    "end_id",
    "pad_id",
    "top_k",
    "top_p",
    "temperature",
    "length_penalty",
    "repetition_penalty",
    "min_length",
    "presence_penalty",
    "frequency_penalty",
    "random_seed",
    "beam_width",
    "num_return_sequences",
    "stream",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
)


def _unwrap_scalar(name: str, value: Any) -> Any:
    """``[x]`` -> ``x`` for a scalar field (Triton accepts both); longer lists are an error."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"'{name}' takes one value, got a list of {len(value)}")
        return value[0]
    return value


class TritonGenerateRequest(BaseModel):
    """Body of ``POST /v2/models/{model}/generate`` and ``.../generate_stream``.

    ``max_tokens`` is required by TensorRT-LLM; here it may be left out to mean "the serving
    default". ``bad_words`` / ``stop_words`` take one string or a list of strings, each one word
    (empty strings, which TensorRT-LLM clients send to mean "none", are dropped). ``end_id``
    adds a token that ends generation (the model's own end-of-sequence token still does);
    ``pad_id`` has no effect here, padding being internal to our servers.
    """

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, description="request id, echoed in the answer")
    text_input: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    bad_words: list[str] = Field(default_factory=list)
    stop_words: list[str] = Field(default_factory=list)
    end_id: int | None = Field(default=None, ge=0)
    pad_id: int | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    length_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_length: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    random_seed: int | None = Field(default=None, ge=0, lt=2**63)
    beam_width: int | None = Field(default=None, ge=1, le=64)
    num_return_sequences: int | None = Field(default=None, ge=1, le=64)
    stream: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False

    @model_validator(mode="before")
    @classmethod
    def _merge_parameters(cls, data: Any) -> Any:
        """Fold Triton's ``parameters`` object into the fields; refuse known unsupported ones."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        parameters = data.pop("parameters", None)
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError("'parameters' must be a JSON object")
            for name, value in parameters.items():
                if name in data:
                    raise ValueError(
                        f"'{name}' is given both in the request and in its 'parameters'"
                    )
                data[name] = value
        for name, reason in UNSUPPORTED_INPUTS.items():
            if name in data:
                raise ValueError(f"'{name}' is not supported: {reason}")
        for name in _SCALAR_FIELDS:
            if name in data:
                data[name] = _unwrap_scalar(name, data[name])
        return data

    @field_validator("bad_words", "stop_words", mode="before")
    @classmethod
    def _words_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [word for word in value if word != ""]
        return value

    @field_validator("stop_words")
    @classmethod
    def _check_stop_words(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop words are allowed")
        return value

    @field_validator("bad_words")
    @classmethod
    def _refuse_bad_words(cls, value: list[str]) -> list[str]:
        if value:
            raise ValueError("banning words is not supported by this server (send an empty list)")
        return value

    @field_validator("return_log_probs", "return_context_logits", "return_generation_logits")
    @classmethod
    def _refuse_extra_outputs(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported: only 'text_output' is returned")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> TritonGenerateRequest:
        # Errors name the Triton fields, so that the native config built later cannot fail.
        if (self.beam_width or 1) > 1:
            for name in ("presence_penalty", "frequency_penalty"):
                if getattr(self, name):
                    raise ValueError(f"'{name}' is not supported with beam search")
        if (
            self.max_tokens is not None
            and self.min_length is not None
            and self.min_length > self.max_tokens
        ):
            raise ValueError(
                f"'min_length' ({self.min_length}) must be <= 'max_tokens' ({self.max_tokens})"
            )
        beams = self.beam_width or 1
        returned = self.num_returned
        if beams > 1 and returned > beams:
            raise ValueError(
                f"'num_return_sequences' ({returned}) must be <= 'beam_width' ({beams})"
            )
        if beams == 1 and returned > 1 and not self.is_sampling:
            raise ValueError(
                "'num_return_sequences' > 1 needs sampling ('top_k' > 1 or 'top_p' > 0) or "
                "'beam_width' >= 'num_return_sequences' (greedy copies would be identical)"
            )
        if self.stream and returned > 1:
            raise ValueError("'stream' is supported for one returned sequence only")
        return self

    @property
    def is_sampling(self) -> bool:
        """True when TensorRT-LLM would sample (see the module docstring for the rule)."""
        if (self.beam_width or 1) > 1 or self.temperature == 0.0:
            return False
        return (self.top_k or 0) > 1 or (self.top_p or 0.0) > 0.0

    @property
    def num_returned(self) -> int:
        """How many texts the answer carries (TensorRT-LLM returns every beam by default)."""
        return self.num_return_sequences or self.beam_width or 1

    def to_generation_config(self) -> GenerationConfig:
        """The same decoding in our native (Hugging Face-named) terms."""
        beams = self.beam_width or 1
        sampling = self.is_sampling
        return GenerationConfig(
            max_new_tokens=self.max_tokens,
            min_new_tokens=self.min_length or 0,
            do_sample=sampling,
            temperature=self.temperature if sampling and self.temperature is not None else 1.0,
            top_k=(self.top_k or 0) if sampling else 0,
            # TensorRT-LLM's top_p 0 means "no nucleus filter", which is 1.0 in HF terms.
            top_p=(self.top_p or 1.0) if sampling else 1.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            num_beams=beams,
            num_return_sequences=self.num_returned,
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            stop=self.stop_words,
            stop_token_ids=[] if self.end_id is None else [self.end_id],
            seed=self.random_seed,
        )

    def to_generate_request(
        self, model: str | None = None, *, streaming_endpoint: bool = False
    ) -> GenerateRequest:
        """The native request for this Triton request.

        The native call streams only on ``generate_stream`` with ``"stream": true``: without
        it TensorRT-LLM sends the whole text as one event. (Real Triton refuses ``generate``
        with ``"stream": true``, answering status 200 with ``{"error": "generate expects model
        to produce exactly 1 response, ..."}``; answering it in one piece is kinder.)
        """
        return GenerateRequest(
            model=model,
            prompt=self.text_input,
            generation_config=self.to_generation_config(),
            stream=streaming_endpoint and self.stream,
        )

    @classmethod
    def from_generate_request(
        cls, request: GenerateRequest, prompt: str, *, default_max_tokens: int
    ) -> TritonGenerateRequest:
        """A Triton request for a native one, to call a Triton server as a backend.

        ``prompt`` is the text to send: Triton + TensorRT-LLM applies no chat template, so a
        ``messages`` request must be rendered by the caller. Raises ``ValueError`` naming the
        ``generation_config`` field that TensorRT-LLM's ensemble cannot express.
        """
        config = request.generation_config
        refused = {
            "typical_p": config.typical_p != 1.0,
            "min_p": config.do_sample and config.min_p > 0.0,
            "logit_bias": bool(config.logit_bias),
            "early_stopping": config.early_stopping is not False,
            "ignore_eos": config.ignore_eos,
            "stop_token_ids": bool(config.stop_token_ids),
            "json_schema": config.json_schema is not None,
            "logprobs": config.logprobs is not None,
            "prompt_logprobs": config.prompt_logprobs is not None,
        }
        for name, is_set in refused.items():
            if is_set:
                raise ValueError(f"generation_config.{name} is not supported by Triton backends")
        if config.num_return_sequences > 1 and not config.is_beam_search:
            raise ValueError(
                "generation_config.num_return_sequences > 1 without beam search is not "
                "supported by Triton backends"
            )
        fields: dict[str, Any] = {
            "text_input": prompt,
            "max_tokens": config.max_new_tokens or default_max_tokens,
            "stop_words": config.stop,
            "random_seed": config.seed,
            "stream": request.stream,
        }
        if config.min_new_tokens:
            fields["min_length"] = config.min_new_tokens
        if config.repetition_penalty != 1.0:
            fields["repetition_penalty"] = config.repetition_penalty
        # The native range is the Triton field's: these cannot fail validation here.
        if config.presence_penalty:
            fields["presence_penalty"] = config.presence_penalty
        if config.frequency_penalty:
            fields["frequency_penalty"] = config.frequency_penalty
        if config.is_beam_search:
            fields["beam_width"] = config.num_beams
            fields["length_penalty"] = config.length_penalty
        elif config.do_sample:
            # top_p is > 0 in a valid native config, which is what makes TensorRT-LLM sample.
            fields.update(temperature=config.temperature, top_p=config.top_p)
            if config.top_k:
                fields["top_k"] = config.top_k
        return cls(**{k: v for k, v in fields.items() if v is not None})

    def to_triton_json(self) -> dict[str, Any]:
        """The JSON body to POST to a Triton server: only the fields that are set."""
        return self.model_dump(exclude_defaults=True)
