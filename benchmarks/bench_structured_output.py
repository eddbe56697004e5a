"""What structured output costs per decode step: the sampler's token choice for a batch of
rows with and without a grammar (a JSON schema, a regex, a choice, a GBNF grammar, the
forced tool calls' grammar), on the default model's vocabulary.

Each constrained row costs a host-side mask (llguidance, per row), the mask's application (one
batched op), and, after the choice, the grammar's advance by the chosen token. The script
times :func:`server.continuous_batching.sampling.draws.sample` on random logits of the model's width
at each batch size, unconstrained and with every row constrained (the matchers advance along
a valid JSON answer, so the masks are those of a real generation), and prints the figures and
their ratio as JSON, per kind of constraint.

Run: ``.venv/bin/python -m benchmarks.bench_structured_output [--batches 1 32] [--steps 40]``
"""

from __future__ import annotations

import json
import time

import torch
from transformers import AutoTokenizer

from benchmarks import median_step_ms, step_bench_parser
from server.common.structured_output import GrammarCompiler, OutputConstraint
from server.common.tool_syntax import HermesSyntax
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.draws import sample
from tools.prepare_model import default_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = '{"name": "Ann Example", "age": 31, "tags": ["red", "blue", "green", "red"]}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
#: Each kind of constraint with a valid answer the matchers advance along.
KINDS: dict[str, tuple[OutputConstraint, str]] = {
    "json_schema": (OutputConstraint.json_schema(SCHEMA), ANSWER),
    "regex": (OutputConstraint("regex", "([a-z]+ ){1,40}"), "the quick brown fox jumps " * 4),
    "choice": (
        OutputConstraint("choice", json.dumps(["Paris is the capital of France", "Rome"])),
        "Paris is the capital of France",
    ),
    "gbnf": (
        OutputConstraint("grammar", 'root ::= item ("," item)*\nitem ::= [a-z]+'),
        "red,green,blue,yellow,orange,purple,black,white",
    ),
    "tool_calls": (
        OutputConstraint("grammar", HermesSyntax().grammar([WEATHER], None, is_parallel=True)),
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}</tool_call>',
    ),
}


def _time_steps(
    num_rows: int,
    num_steps: int,
    compiler: GrammarCompiler | None,
    tokens: list[int],
    constraint: OutputConstraint | None = None,
) -> float:
    """Median milliseconds of one ``sample`` call (plus the grammars' advance)."""
    vocab_size = compiler.vocab_size if compiler else 49152
    matchers = []
    if compiler is not None and constraint is not None:
        matchers = [compiler.matcher(constraint) for _ in range(num_rows)]
    rows = [RowParams(grammar=m) for m in matchers] or [RowParams() for _ in range(num_rows)]

    def step(index: int, logits: torch.Tensor) -> None:
        sample(logits, rows)
        for matcher in matchers:  # what the bookkeeping does after the choice
            matcher.accept(tokens[index])

    num_timed = min(num_steps, len(tokens))
    return median_step_ms(num_timed, lambda _: torch.randn(num_rows, vocab_size), step)


def main() -> None:
    parser = step_bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    setup_ms = 1000 * (time.perf_counter() - start)
    kinds = []
    for name, (constraint, answer) in KINDS.items():
        start = time.perf_counter()
        compiler.grammar(constraint)
        compile_ms = 1000 * (time.perf_counter() - start)
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        results = []
        for num_rows in args.batches:
            free = _time_steps(num_rows, args.steps, None, tokens)
            constrained = _time_steps(num_rows, args.steps, compiler, tokens, constraint)
            results.append(
                {
                    "batch": num_rows,
                    "free_step_ms": round(free, 3),
                    "constrained_step_ms": round(constrained, 3),
                    "extra_ms": round(constrained - free, 3),
                    "extra_ms_per_row": round((constrained - free) / num_rows, 4),
                }
            )
        kinds.append(
            {
                "kind": name,
                "compile_ms": round(compile_ms, 2),
                "num_steps": min(args.steps, len(tokens)),
                "steps": results,
            }
        )
    report = {
        "tokenizer_setup_ms": round(setup_ms, 1),
        "torch_threads": torch.get_num_threads(),
        "kinds": kinds,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
