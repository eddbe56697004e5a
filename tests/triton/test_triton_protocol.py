"""Triton generate API models: validation, TensorRT-LLM decoding rules, native conversions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from client.triton.protocol import TritonGenerateRequest
from client.triton.responses import (
    TritonErrorResponse,
    TritonGenerateResponse,
    triton_response,
    triton_stream_response,
)
from protocol.generation import (
    Choice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    Usage,
)
from utils.errors import describe_validation_error


def _refusal(body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError, match="validation error for TritonGenerateRequest") as info:
        TritonGenerateRequest.model_validate(body)
    return describe_validation_error(info.value)


def _sent(**fields: object) -> dict[str, object]:
    """The Triton JSON sent for prompt "p": its ``text_input`` and ``fields``."""
    return {"text_input": "p", **fields}


def test_the_seed_request_maps_to_greedy() -> None:
    # The request of a Triton + TensorRT-LLM deployment guide, verbatim.
    request = TritonGenerateRequest.model_validate(
        {
            "text_input": "What is machine learning?",
            "max_tokens": 100,
            "bad_words": "",
            "stop_words": "",
            "pad_id": 2,
            "end_id": 2,
        }
    )
    native = request.to_generate_request("SmolLM2-135M-Instruct")
    assert native.model == "SmolLM2-135M-Instruct"
    assert native.prompt == "What is machine learning?"
    assert native.stream is False
    config = native.generation_config
    assert config.max_new_tokens == 100
    assert not config.do_sample and config.num_beams == 1
    assert config.stop == [] and config.stop_token_ids == [2]


def test_parameters_object_and_one_element_lists_are_folded_in() -> None:
    request = TritonGenerateRequest.model_validate(
        {
            "text_input": ["hi"],
            "parameters": {"max_tokens": [8], "stop_words": ["\n", ""], "stream": True},
        }
    )
    assert request.text_input == "hi"
    assert request.max_tokens == 8
    assert request.stop_words == ["\n"]
    assert request.stream is True


@pytest.mark.parametrize(
    ("fields", "sampling"),
    [
        ({}, False),  # top_k = top_p = 0: TensorRT-LLM's greedy default
        ({"temperature": 0.7}, False),  # temperature alone does not turn sampling on
        ({"top_k": 1, "temperature": 0.7}, False),
        ({"top_k": 40}, True),
        ({"top_p": 0.9}, True),
        ({"top_p": 0.9, "temperature": 0.0}, False),
        ({"top_k": 40, "beam_width": 2}, False),
    ],
)
def test_tensorrt_llm_sampling_rule(fields: dict, sampling: bool) -> None:
    request = TritonGenerateRequest.model_validate({"text_input": "x", **fields})
    assert request.is_sampling is sampling
    assert request.to_generation_config().do_sample is sampling


def test_sampling_fields_map_to_hugging_face_names() -> None:
    config = TritonGenerateRequest.model_validate(
        {
            "text_input": "x",
            "max_tokens": 32,
            "temperature": 0.7,
            "top_k": 40,
            "top_p": 0.0,  # TensorRT-LLM's "no nucleus filter"
            "random_seed": 7,
            "repetition_penalty": 1.1,
            "min_length": 4,
            "stop_words": ["\n\n", "###"],
        }
    ).to_generation_config()
    assert (config.temperature, config.top_k, config.top_p) == (0.7, 40, 1.0)
    assert (config.seed, config.repetition_penalty, config.min_new_tokens) == (7, 1.1, 4)
    assert config.stop == ["\n\n", "###"]


def test_beam_search_returns_every_beam_by_default() -> None:
    config = TritonGenerateRequest.model_validate(
        {"text_input": "x", "beam_width": 4, "length_penalty": 0.5}
    ).to_generation_config()
    assert (config.num_beams, config.num_return_sequences, config.length_penalty) == (4, 4, 0.5)
    narrowed = TritonGenerateRequest.model_validate(
        {"text_input": "x", "beam_width": 4, "num_return_sequences": 1}
    ).to_generation_config()
    assert narrowed.num_return_sequences == 1


def test_native_stream_only_on_generate_stream_with_stream_true() -> None:
    streaming = TritonGenerateRequest.model_validate({"text_input": "x", "stream": True})
    quiet = TritonGenerateRequest.model_validate({"text_input": "x"})
    assert streaming.to_generate_request(streaming_endpoint=True).stream is True
    assert streaming.to_generate_request(streaming_endpoint=False).stream is False
    assert quiet.to_generate_request(streaming_endpoint=True).stream is False


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"text_input": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"text_input": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"text_input": "x", "beam_width": 2, "presence_penalty": 0.5}, "presence_penalty"),
        ({"text_input": "x", "bad_words": ["Paris"]}, "bad_words"),
        ({"text_input": "x", "return_log_probs": True}, "return_log_probs"),
        ({"text_input": "x", "return_generation_logits": True}, "return_generation_logits"),
        ({"text_input": "x", "lora_task_id": 3}, "lora_task_id"),
        ({"text_input": "x", "sampling_parameters": "{}"}, "sampling_parameters"),
        ({"text_input": "x", "prompt_embedding_table": [[0.0]]}, "prompt_embedding_table"),
        ({"text_input": "x", "foo": 1}, "foo"),
        ({"text_input": "x", "top_p": 1.5}, "top_p"),
        ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "x", "beam_width": 0}, "beam_width"),
        ({"text_input": ""}, "text_input"),
        ({"text_input": ["a", "b"]}, "text_input"),
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "x", "max_tokens": 4, "parameters": {"max_tokens": 8}}, "max_tokens"),
        ({"text_input": "x", "max_tokens": 4, "min_length": 5}, "min_length"),
        ({"text_input": "x", "beam_width": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"text_input": "x", "num_return_sequences": 2}, "num_return_sequences"),
        ({"text_input": "x", "beam_width": 2, "stream": True}, "stream"),
    ],
)
def test_refusals_name_the_field(body: dict, named: str) -> None:
    message, param = _refusal(body)
    assert named in message
    assert param in ("", named)


def test_field_level_refusals_carry_the_param() -> None:
    assert _refusal({"text_input": "x", "presence_penalty": 3})[1] == "presence_penalty"
    assert _refusal({"text_input": "x", "bad_words": ["a"]})[1] == "bad_words"


def _native(texts: list[str]) -> GenerateResponse:
    return GenerateResponse(
        id="gen-1",
        model="SmolLM2-135M-Instruct",
        choices=[Choice(index=i, text=t, finish_reason="stop") for i, t in enumerate(texts)],
        usage=Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12),
    )


def test_native_answer_to_triton_shape() -> None:
    answer = triton_response(_native(["The capital of France is Paris."]), "ensemble")
    assert answer.to_json() == {
        "model_name": "ensemble",
        "model_version": "1",
        "text_output": "The capital of France is Paris.",
    }
    with_id = triton_response(_native(["a", "b"]), "ensemble", request_id="r-1")
    assert with_id.to_json() == {
        "id": "r-1",
        "model_name": "ensemble",
        "model_version": "1",
        "text_output": ["a", "b"],
    }
    assert list(with_id.to_json()) == ["id", "model_name", "model_version", "text_output"]


def test_native_stream_chunks_to_triton_events() -> None:
    delta = GenerateStreamChunk(id="gen-1", model="m", choices=[Choice(index=0, text="Paris")])
    event = triton_stream_response(delta, "ensemble")
    assert event is not None and event.to_json()["text_output"] == "Paris"
    last = GenerateStreamChunk(
        id="gen-1",
        model="m",
        choices=[Choice(index=0, text="", finish_reason="stop")],
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    assert triton_stream_response(last, "ensemble") is None  # Triton's stream just ends


def test_triton_answers_parse() -> None:
    one = TritonGenerateResponse.model_validate(
        {"model_name": "ensemble", "model_version": "1", "text_output": "Paris"}
    )
    beams = TritonGenerateResponse.model_validate(
        {"model_name": "ensemble", "model_version": "1", "text_output": ["a", "b"]}
    )
    assert one.texts() == ["Paris"] and beams.texts() == ["a", "b"]
    assert TritonErrorResponse.model_validate({"error": "boom"}).error == "boom"


def test_native_request_to_triton_json() -> None:
    greedy = GenerateRequest(prompt="p", generation_config={"stop": ["\n"], "seed": 3})
    assert TritonGenerateRequest.from_generate_request(
        greedy, "P", default_max_tokens=64
    ).to_triton_json() == {
        "text_input": "P",
        "max_tokens": 64,
        "stop_words": ["\n"],
        "random_seed": 3,
    }

    sampled = GenerateRequest(
        prompt="p",
        generation_config={"max_new_tokens": 5, "do_sample": True, "temperature": 0.5},
        stream=True,
    )
    request = TritonGenerateRequest.from_generate_request(sampled, "p", default_max_tokens=64)
    assert request.to_triton_json() == _sent(max_tokens=5, temperature=0.5, top_p=1.0, stream=True)
    # Read back, it is the same decoding.
    back = request.to_generation_config()
    assert back.do_sample and back.temperature == 0.5 and back.max_new_tokens == 5

    beams = GenerateRequest(
        prompt="p", generation_config={"num_beams": 3, "num_return_sequences": 2}
    )
    assert TritonGenerateRequest.from_generate_request(
        beams, "p", default_max_tokens=8
    ).to_triton_json() == _sent(max_tokens=8, beam_width=3, length_penalty=1.0)


def test_additive_penalties_map_both_ways() -> None:
    """TensorRT-LLM's presence and frequency penalties are the native fields of those names."""
    triton = TritonGenerateRequest.model_validate(
        {"text_input": "x", "presence_penalty": 0.5, "parameters": {"frequency_penalty": [-1.0]}}
    )
    config = triton.to_generation_config()
    assert (config.presence_penalty, config.frequency_penalty) == (0.5, -1.0)
    native = GenerateRequest(
        prompt="p", generation_config={"presence_penalty": 1.5, "frequency_penalty": 0.25}
    )
    sent = TritonGenerateRequest.from_generate_request(native, "p", default_max_tokens=8)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.25}
    assert sent.to_triton_json() == _sent(max_tokens=8, **penalties)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"typical_p": 0.5}, "typical_p"),
        ({"do_sample": True, "min_p": 0.1}, "min_p"),
        ({"logit_bias": {"42": 1.0}}, "logit_bias"),
        ({"ignore_eos": True}, "ignore_eos"),
        ({"stop_token_ids": [7]}, "stop_token_ids"),
        ({"num_beams": 2, "early_stopping": True}, "early_stopping"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences"),
    ],
)
def test_native_features_triton_cannot_express(config: dict, named: str) -> None:
    native = GenerateRequest(prompt="p", generation_config=config)
    with pytest.raises(ValueError, match=named):
        TritonGenerateRequest.from_generate_request(native, "p", default_max_tokens=8)
