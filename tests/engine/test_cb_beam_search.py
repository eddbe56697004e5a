"""BeamSearchState against transformers' own beam search on the default model.

Two kinds of checks:

- replay: ``model.generate`` runs with a logits processor that records, at every step, the
  running sequences HF feeds the model and the processed log-probs it gets back. Our state is
  fed the candidates ``top_beam_candidates`` takes from those log-probs and must hold exactly
  the same running sequences at every step, stop at the same step and return the same
  hypotheses and scores. Feeding HF's own numbers makes the comparison bit-exact (the state's
  plain-Python float32 arithmetic included) and lets one cheap ``generate`` call cover the
  whole grid of num_beams x length_penalty x early_stopping x eos / ignore_eos, every
  num_return_sequences.
- engine loop: the state drives the HF model as its scorer (full recompute per step, no cache),
  with our ``beam_log_probs`` doing repetition penalty and min_new_tokens, like the engine.

The state's bookkeeping without a model or torch is in ``test_cb_beam_bookkeeping.py``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from server.continuous_batching.decoding.beam_search import BeamSearchState
from server.continuous_batching.decoding.cpu_topk_order import topk_indices
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.beam_candidates import beam_log_probs, top_beam_candidates

EOS = 2  # <|im_end|>, also the model's pad id
# Greedy answers "2 + 2 = 4<|im_end|>": EOS arrives after ~8 tokens, so hypotheses finish while
# other beams keep running and every branch of the finished-beam logic is exercised.
EOS_PROMPT = "What is 2+2? Answer with a number only."
MAX_NEW = 11


class Recorder(LogitsProcessor):
    """Records (running sequences, processed log-probs) at each beam search step."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append((input_ids.clone(), scores.clone()))
        return scores


@pytest.fixture(scope="module")
def hf(default_model_path: Path) -> tuple[Any, Any]:
    """The default model (float32) and its tokenizer, loaded once."""
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    return model.eval(), tokenizer


def chat_ids(tokenizer: Any, text: str) -> torch.Tensor:
    """``[1, P]`` prompt ids of a one-message chat."""
    messages = [{"role": "user", "content": text}]
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"]


def hf_beam_search(
    model: Any, prompt: torch.Tensor, recorder: Recorder | None = None, **kwargs: Any
) -> tuple[list[list[int]], list[float]]:
    """Rows of ``generate`` after the prompt (pads included) and their sequence scores."""
    with torch.no_grad():
        out = model.generate(
            prompt,
            # Explicit mask: with eos_token_id=None HF would infer one from the pad id (2), which
            # also is the chat template's <|im_end|>, and mask the prompt's turn separators.
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            logits_processor=[recorder] if recorder is not None else None,
            **kwargs,
        )
    rows = out.sequences[:, prompt.shape[1] :].tolist()
    return rows, out.sequences_scores.tolist()


def beam_options(*case: Any) -> dict[str, Any]:
    """``generate``'s beam-search options for one case: num_beams, num_return, length_penalty,
    early_stopping, eos (False: no EOS, every hypothesis runs to ``MAX_NEW``), min_new."""
    num_beams, num_return, length_penalty, early_stopping, eos, min_new = case
    return {
        "num_beams": num_beams,
        "num_return_sequences": num_return,
        "max_new_tokens": MAX_NEW,
        "min_new_tokens": min_new,
        "length_penalty": length_penalty,
        "early_stopping": early_stopping,
        "eos_token_id": EOS if eos else None,
    }


def assert_same_hypotheses(
    ours: list[tuple[list[int], float]], rows: list[list[int]], scores: list[float], exact: bool
) -> None:
    """Our hypotheses equal HF's rows once HF's right padding (``EOS``) is stripped."""
    assert len(ours) == len(rows)
    # HF crops its output to the longest returned hypothesis and pads the others.
    assert len(rows[0]) == max(len(tokens) for tokens, _ in ours)
    for (tokens, score), row, hf_score in zip(ours, rows, scores, strict=True):
        assert row[: len(tokens)] == tokens
        assert all(t == EOS for t in row[len(tokens) :])
        if exact:
            assert score == hf_score
        else:
            assert score == pytest.approx(hf_score, abs=1e-4)


def replay(state: BeamSearchState, recorder: Recorder, prompt_len: int) -> None:
    """Step ``state`` with HF's recorded log-probs, checking the running beams at each step."""
    for step, (input_ids, log_probs) in enumerate(recorder.steps):
        assert not state.is_done, f"stopped early, before step {step}"
        n = state.num_running
        assert state.running_token_ids() == input_ids[:n, prompt_len:].tolist()
        banned = log_probs[:n, EOS] == -float("inf")
        assert bool(banned.all()) == bool(state.banned_token_ids())
        state.step(top_beam_candidates(log_probs[:n], state.running_scores, state.num_candidates))
    assert state.is_done, "HF stopped but our state would go on"


# (num_beams, num_return_sequences asked of HF, length_penalty, early_stopping, eos, min_new)
# num_beams=4 crosses every length_penalty with every early_stopping; 2 and 3 cover each value
# once (a Latin square), which keeps the module at ~20 generate calls on a shared 2-core box.
CASES = [
    *[(4, 4, lp, es, True, 0) for lp in (1.0, 0.5, 2.0) for es in (True, False, "never")],
    (2, 2, 1.0, True, True, 0),
    (2, 1, 0.5, False, True, 0),
    (2, 2, 2.0, "never", True, 0),
    (3, 3, 1.0, False, True, 0),
    (3, 3, 0.5, "never", True, 0),
    (3, 2, 2.0, True, True, 0),
    # ignore_eos: every hypothesis finishes at max_new_tokens.
    (2, 2, 1.0, False, False, 0),
    (3, 3, 2.0, "never", False, 0),
    (4, 3, 0.5, True, False, 0),
    # min_new_tokens past the natural EOS (~8th token): HF bans EOS until then.
    (3, 3, 1.0, False, True, 9),
]


@pytest.mark.parametrize("num_beams,hf_return,length_penalty,early_stopping,eos,min_new", CASES)
def test_replay_matches_hf(
    hf: tuple[Any, Any],
    num_beams: int,
    hf_return: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos: bool,
    min_new: int,
) -> None:
    model, tokenizer = hf
    prompt = chat_ids(tokenizer, EOS_PROMPT)
    recorder = Recorder()
    options = beam_options(num_beams, hf_return, length_penalty, early_stopping, eos, min_new)
    rows, scores = hf_beam_search(model, prompt, recorder, **options)
    # The recorded steps do not depend on num_return_sequences, which only slices the final
    # hypotheses: one HF call checks every R <= hf_return.
    for r in range(1, hf_return + 1):
        state = BeamSearchState(
            num_beams,
            r,
            length_penalty,
            early_stopping,
            [EOS] if eos else [],
            prompt.shape[1],
            MAX_NEW,
            min_new,
        )
        replay(state, recorder, prompt.shape[1])
        longest = max(len(tokens) for tokens, _ in state.finished())
        assert_same_hypotheses(
            state.finished(), [row[:longest] for row in rows[:r]], scores[:r], exact=True
        )
        if not eos:
            assert all(len(tokens) == MAX_NEW for tokens, _ in state.finished())


def drive(
    model: Any, prompt: torch.Tensor, state: BeamSearchState, repetition_penalty: float
) -> None:
    """Run ``state`` to completion as the engine does, the HF model scoring every step."""
    prompt_ids = prompt[0].tolist()
    beams: list[list[int]] = [[]]  # generated ids per running row, maintained from step()
    while not state.is_done:
        sequences = [prompt_ids + beam for beam in beams]
        with torch.no_grad():
            logits = model(torch.tensor(sequences)).logits[:, -1, :]
        rows = [
            RowParams(
                is_greedy=True,
                repetition_penalty=repetition_penalty,
                banned_token_ids=state.banned_token_ids(),
                # HF penalises over input_ids: prompt + generated.
                penalty_token_ids=sequence if repetition_penalty != 1.0 else None,
            )
            for sequence in sequences
        ]
        log_probs = beam_log_probs(logits, rows)
        pairs = state.step(
            top_beam_candidates(log_probs, state.running_scores, state.num_candidates)
        )
        assert len(pairs) == state.num_beams
        beams = [beams[parent] + [token] for parent, token in pairs]
        if not state.is_done:
            assert beams == state.running_token_ids()


@pytest.mark.parametrize(
    "num_beams,num_return,length_penalty,early_stopping,eos,min_new,penalty",
    [
        (3, 2, 1.0, False, True, 9, 1.3),
        (2, 2, 0.5, True, False, 0, 1.2),
    ],
)
def test_engine_loop_matches_generate(
    hf: tuple[Any, Any],
    num_beams: int,
    num_return: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos: bool,
    min_new: int,
    penalty: float,
) -> None:
    model, tokenizer = hf
    prompt = chat_ids(tokenizer, EOS_PROMPT)
    eos_ids = [EOS] if eos else []
    state = BeamSearchState(
        num_beams,
        num_return,
        length_penalty,
        early_stopping,
        eos_ids,
        prompt.shape[1],
        MAX_NEW,
        min_new,
    )
    drive(model, prompt, state, penalty)
    options = beam_options(num_beams, num_return, length_penalty, early_stopping, eos, min_new)
    rows, scores = hf_beam_search(model, prompt, repetition_penalty=penalty, **options)
    # Full recompute vs HF's KV cache: same tokens, scores equal up to float noise.
    assert_same_hypotheses(state.finished(), rows, scores, exact=False)


def test_candidates_are_hf_top_k_continuations() -> None:
    """``top_beam_candidates``: the prompt row stands for every beam on the first step (the
    copies at -1e9 lose), then (row, token) come from the flat index, best first."""
    log_probs = torch.log_softmax(torch.arange(10, dtype=torch.float32), dim=-1)
    first = top_beam_candidates(log_probs[None], [0.0, -1.0e9], 4)
    assert [(c.row, c.token) for c in first] == [(0, 9), (0, 8), (0, 7), (0, 6)]
    assert [c.score for c in first] == log_probs[[9, 8, 7, 6]].tolist()
    scores = [-0.5, -0.25]  # row 1 runs ahead: its best tokens come first
    later = top_beam_candidates(log_probs.expand(2, -1), scores, 3)
    assert [(c.row, c.token) for c in later] == [(1, 9), (0, 9), (1, 8)]
    assert later[0].score == (log_probs[9] + torch.tensor(-0.25)).item()
    with pytest.raises(ValueError, match="3 log-prob rows for 2 beams"):
        top_beam_candidates(log_probs.expand(3, -1), scores, 3)


def test_cpu_topk_order_matches_torch() -> None:
    """``topk_indices`` picks and orders as ``torch.topk`` on a CPU, ties included: few
    distinct values (ties everywhere), NaN and infinities, sorted and patterned inputs (which
    drive libstdc++'s introselect to its heap fallback), and both of torch's paths (k * 64 <= n
    or not)."""
    rng = random.Random(0)
    pools = [[0.0, 1.0], [0.0, -0.5, -1.0e9], [0.0, 1.0, math.nan, -math.inf, math.inf]]
    for _ in range(3000):
        n = rng.choice([rng.randint(1, 24), rng.randint(1, 200)])
        kind = rng.randrange(4)
        if kind == 0:
            values = [rng.choice(rng.choice(pools)) for _ in range(n)]
        elif kind == 1:
            values = sorted(rng.random() for _ in range(n))
        elif kind == 2:
            values = [float(min(i, n - i) % rng.randint(2, 9)) for i in range(n)]
        else:
            values = [rng.random() for _ in range(n)]
        k = rng.randint(1, n) if rng.random() < 0.7 else rng.randint(1, max(1, n // 64))
        tensor = torch.tensor(values, dtype=torch.float32)
        # The float32 values, as the beam state holds them.
        assert topk_indices(tensor.tolist(), k) == torch.topk(tensor, k)[1].tolist()
