"""Structured output's grammar side (llguidance) on the default model's tokenizer: schemas
compiled once, the token bitmask allowing exactly what keeps the output valid, and the mask
applied to chosen logits rows alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from server.common.structured_output import (
    GrammarCompiler,
    GrammarError,
    OutputConstraint,
    allocate_bitmask,
    apply_bitmask,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id])


def _walk(compiler: GrammarCompiler, tokenizer: Any, text: str) -> tuple[bool, bool]:
    """Feed ``text``'s tokens through the mask: (every token allowed, grammar complete)."""
    matcher = compiler.matcher(OutputConstraint.json_schema(SCHEMA))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, compiler.vocab_size)
        apply_bitmask(logits, bitmask, [0])
        if logits[0, token] == float("-inf") or not matcher.accept(token):
            return False, False
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask(logits, bitmask, [0])
    can_end = logits[0, tokenizer.eos_token_id] != float("-inf")
    return True, can_end


def test_valid_output_is_allowed_token_by_token(compiler: GrammarCompiler, tokenizer: Any) -> None:
    valid = {"name": "Ann", "age": 31, "city": {"zip": "75001"}, "tags": ["red", "blue"]}
    assert _walk(compiler, tokenizer, json.dumps(valid, separators=(",", ":"))) == (True, True)
    # A prefix is allowed but cannot end there.
    assert _walk(compiler, tokenizer, '{"name":"Ann","age":3') == (True, False)


@pytest.mark.parametrize(
    "invalid",
    [
        '{"name":"Ann","city":{"zip":"1"}}',  # "age" is required
        '{"name":"Ann","age":"31","city":{"zip":"1"}}',  # age is an integer
        '{"name":"Ann","age":1,"city":{"zip":"1"},"tags":["green"]}',  # not in the enum
        '{"name":"Ann","age":1,"city":{"zip":"1"},"extra":1}',  # no other properties
        'Sure! {"name":"Ann"}',  # nothing before the object
    ],
)
def test_invalid_output_is_masked(compiler: GrammarCompiler, tokenizer: Any, invalid: str) -> None:
    assert _walk(compiler, tokenizer, invalid) != (True, True)


def test_schemas_compile_once_and_bad_ones_are_named(compiler: GrammarCompiler) -> None:
    first = compiler.grammar(OutputConstraint.json_schema(SCHEMA))
    # The same schema again (another request) is the cached grammar.
    assert compiler.grammar(OutputConstraint.json_schema(json.loads(json.dumps(SCHEMA)))) is first
    with pytest.raises(GrammarError, match="cannot be compiled"):
        compiler.grammar(OutputConstraint.json_schema({"type": "object", "minProperties": "x"}))


def test_the_mask_touches_its_rows_only(compiler: GrammarCompiler) -> None:
    matcher = compiler.matcher(OutputConstraint.json_object())
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = logits[1] != float("-inf")
    assert 0 < int(allowed.sum()) < compiler.vocab_size // 10  # an object starts with "{"
    assert torch.equal(logits[1][allowed], before[1][allowed])
    # A fork follows its own path.
    fork = matcher.fork()
    assert not fork.is_finished


def test_a_tokenizer_llguidance_cannot_read_turns_the_feature_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server whose tokenizer llguidance cannot read (a slow one) still starts; requests
    for structured output get a 400 that says why."""
    from types import SimpleNamespace

    from protocol.generation import GenerationConfig
    from protocol.health import LoadReport
    from server.common.metrics import ServerMetrics
    from server.common.request_context import RequestRecord
    from server.common.service import GenerationService, ServingSettings
    from utils.errors import APIError

    class SlowTokenizer:  # not a transformers fast tokenizer
        eos_token_id = 2
        chat_template = None

        def __len__(self) -> int:
            return 10

    slow_tokenizer = SlowTokenizer()
    backend = SimpleNamespace(
        kind="continuous_batching",
        tokenizer=slow_tokenizer,
        max_model_len=64,
        is_structured_output_supported=True,
    )
    settings = ServingSettings(served_model_names=["m"])
    service = GenerationService(backend, settings, ServerMetrics(LoadReport))  # type: ignore[arg-type]
    assert service.grammars is None and "tokenizer" in (service.no_grammar_reason or "")
    assert "structured output is off" in caplog.text
    config = GenerationConfig(max_new_tokens=4, json_schema={"type": "object"})
    with pytest.raises(APIError) as refused:
        service.make_job("r", [[1, 2]], config, RequestRecord(request_id="r", endpoint="/x"))
    assert refused.value.status_code == 400 and "tokenizer" in refused.value.message


def _accepts(
    compiler: GrammarCompiler, tokenizer: Any, constraint: OutputConstraint, text: str
) -> bool:
    """True when every token of ``text`` is allowed in turn by ``constraint``'s grammar."""
    matcher = compiler.matcher(constraint)
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_structural_tag_constrains_only_the_tagged_parts(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    from protocol.structured_outputs import StructuredOutputs

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=weather>", "schema": weather, "end": "</f>"}],
        "triggers": ["<f="],
    }
    source = StructuredOutputs.model_validate({"structural_tag": json.dumps(tag)}).grammar_source()
    constraint = OutputConstraint(*source)
    assert _accepts(compiler, tokenizer, constraint, 'Let me look. <f=weather>{"city":"Oslo"}</f>')
    assert _accepts(compiler, tokenizer, constraint, "No call at all, just text.")
    assert not _accepts(compiler, tokenizer, constraint, '<f=weather>{"town":"Oslo"}</f>')
    assert not _accepts(compiler, tokenizer, constraint, "<f=rain>")  # no such structure


@pytest.mark.parametrize(
    ("kind", "text", "good", "bad"),
    [
        ("regex", r"[0-9]{3}-[0-9]{4}", "555-1234", "555-12a"),
        ("choice", json.dumps(["Paris", "Lyon"]), "Lyon", "London"),
        ("grammar", 'root ::= "a" root | "b"', "aaab", "aaba"),
        ("grammar", 'start: "x" "y"*', "xyyy", "yx"),
    ],
)
def test_each_kind_allows_its_sentences_alone(
    compiler: GrammarCompiler, tokenizer: Any, kind: str, text: str, good: str, bad: str
) -> None:
    constraint = OutputConstraint(kind, text)
    assert _accepts(compiler, tokenizer, constraint, good)
    assert not _accepts(compiler, tokenizer, constraint, bad)
