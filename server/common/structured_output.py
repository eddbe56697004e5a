"""Structured output: generation constrained to a JSON schema (or any JSON object), a regex,
a choice, a GBNF/Lark grammar or a structural tag, token by token, with llguidance.

Why llguidance (over xgrammar and outlines-core): it has no run-time dependencies (a Rust core
with a small Python binding; xgrammar pulls in triton and a TVM runtime), computes a step's
token mask in tens of microseconds without a precompilation pass over the vocabulary, supports
JSON Schema (strict) directly, and is what vLLM, SGLang and llama.cpp use as their guidance
backend. The mask is a bitmask of 32-bit words per row, applied to the logits before sampling.

:class:`GrammarCompiler` belongs to a model (its tokenizer): it validates and caches grammars
by schema, so one schema is compiled once. :class:`GrammarMatcher` follows one sequence: the
mask for its next token, the token it took, whether the grammar is complete. Only
:func:`apply_bitmask` touches tensors (torch is imported there, so the engine's plain-Python
bookkeeping can hold matchers without importing torch).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: What a request may constrain its output to.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A schema the grammar library cannot compile (the message says why)."""


#: What each kind of constraint is called in an error message.
_KIND_NAMES: dict[str, str] = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


@dataclass(frozen=True)
class OutputConstraint:
    """A request's constraint: its kind (``protocol.structured_outputs.GrammarKind``) and its
    text (a JSON schema's JSON, a regex, a JSON list of choices, a GBNF or Lark grammar, or a
    structural tag's JSON)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> OutputConstraint:
        """Output that validates against ``schema`` (keys not sorted: the order of
        ``properties`` is the order the output writes them in)."""
        return cls("json", json.dumps(schema))

    @classmethod
    def json_object(cls) -> OutputConstraint:
        """Any JSON object."""
        return cls.json_schema(JSON_OBJECT_SCHEMA)


def _lark_choice(choices: list[str]) -> str:
    """A Lark grammar whose only sentences are ``choices`` (JSON strings are Lark literals)."""
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def _lark_structural_tag(text: str) -> str:
    """A Lark grammar of vLLM's structural tag: free text in which each part that begins with
    a structure's ``begin`` continues with JSON valid against its ``schema``, then ``end``."""
    import llguidance

    from protocol.structured_outputs import structural_tags

    tag = structural_tags(text)
    tags = [
        llguidance.StructTag(
            trigger=tag.trigger_of(structure) or structure.begin,
            begin=structure.begin,
            grammar=structure.schema_,
            end=structure.end,
        )
        for structure in tag.structures
    ]
    # Triggers are matched as text: they need not be special tokens of the tokenizer.
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar of a constraint; ``GrammarError`` when it cannot be compiled.
    JSON is written without optional whitespace (as vLLM's ``disable_any_whitespace``)."""
    import llguidance

    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_lark_choice(json.loads(text)))
        if kind == "grammar":  # GBNF (llama.cpp's) or Lark, told apart by llguidance
            return llguidance.grammar_from("grammar", text)
        if kind == "structural_tag":
            return llguidance.LLMatcher.grammar_from_lark(_lark_structural_tag(text))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the {_KIND_NAMES[kind]} cannot be compiled: {exc}") from None
    raise GrammarError(f"unknown kind of constraint {kind!r}")


class GrammarCompiler:
    """Compiles constraints into grammars for one tokenizer; each constraint once (cached)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int | None = None, eos_token_ids: list[int] | None = None
    ) -> None:
        import llguidance.hf

        # Built once: it walks the vocabulary (about 0.3 s for 49k tokens). ``vocab_size`` is
        # the model's logits width, which may exceed the tokenizer's.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token_ids or None)
        self.vocab_size: int = self.tokenizer.vocab_size
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def _compile_uncached(self, constraint: OutputConstraint) -> str:
        import llguidance

        grammar = compile_grammar(constraint.kind, constraint.text)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:  # "" when the grammar is fine
            raise GrammarError(f"the {_KIND_NAMES[constraint.kind]} cannot be compiled: {error}")
        return grammar

    def grammar(self, constraint: OutputConstraint) -> str:
        """The compiled grammar of ``constraint`` (cached); :class:`GrammarError` if none."""
        return self._compile(constraint)

    def matcher(self, constraint: OutputConstraint) -> GrammarMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            name = _KIND_NAMES.get(constraint.kind, constraint.kind)
            raise GrammarError(f"the {name} cannot be compiled: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """Where one sequence is in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        #: The tokenizer's vocabulary the masks cover (the bitmask's width, in tokens).
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (int32 words, CPU)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """True when the grammar is complete: nothing may follow but the end."""
        return bool(self._matcher.is_stopped())

    def fork(self) -> GrammarMatcher:
        """An independent copy (for a sequence forked into several)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)


def allocate_bitmask(num_rows: int, vocab_size: int) -> Any:
    """A CPU bitmask for ``num_rows`` rows (all tokens allowed until filled)."""
    import llguidance.torch

    return llguidance.torch.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place: row ``i`` of ``bitmask`` (32
    tokens a word, low bit first) constrains row ``rows[i]`` of ``logits``; other rows are left
    alone. Plain torch ops, so the same on a CPU and on cuda."""
    import torch  # here: the matcher side is used by torch-free bookkeeping

    if not rows:
        return
    vocab_size = logits.shape[-1]
    words = bitmask[: len(rows)].to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:  # tokens past the mask's words are never allowed
        padding = allowed.new_zeros(len(rows), vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, padding], dim=1)
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    constrained.masked_fill_(~allowed[:, :vocab_size], float("-inf"))
    logits.index_copy_(0, index, constrained)
