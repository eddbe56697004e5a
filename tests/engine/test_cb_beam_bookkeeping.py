"""Beam search bookkeeping without a model or torch: hand-made candidates, exact float32 scores.

The scores below are sums of powers of two, so float32 holds them exactly and each expected
value can be checked by hand. transformers' own beam search is the reference in
``test_cb_beam_search.py`` (with torch and the default model); these tests pin the rules one
at a time: which candidates keep running, which finish, the length penalty, the three
early-stopping modes, ``num_return_sequences``, and ties.
"""

from __future__ import annotations

import math

import pytest

from server.continuous_batching.decoding.beam_search import BeamCandidate, BeamSearchState, float32
from server.continuous_batching.decoding.cpu_topk_order import topk_indices

EOS = 0
PROMPT = 5


def state(
    num_beams: int = 2,
    num_return: int = 2,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos: list[int] | None = None,
    max_new: int = 4,
    min_new: int = 0,
) -> BeamSearchState:
    return BeamSearchState(
        num_beams,
        num_return,
        length_penalty,
        early_stopping,
        [EOS] if eos is None else eos,
        PROMPT,
        max_new,
        min_new,
    )


def cands(*triples: tuple[int, int, float]) -> list[BeamCandidate]:
    return [BeamCandidate(*triple) for triple in triples]


# Step 1 from the prompt: token 1 leads, EOS (ranked 2nd, so within the top num_beams=2)
# finishes the hypothesis [EOS] with -1.0.
STEP_1 = cands((0, 1, -0.5), (0, EOS, -1.0), (0, 2, -1.5), (0, 3, -2.0))


def test_first_step_runs_the_best_unfinished_candidates() -> None:
    beams = state()
    assert beams.num_running == 1 and beams.num_candidates == 4  # (1 + one EOS id) x 2 beams
    assert beams.running_scores == [0.0, -1.0e9]  # the prompt's copies 1.. lose
    assert beams.step(STEP_1) == [(0, 1), (0, 2)]  # EOS finished: it does not run
    assert beams.running_token_ids() == [[1], [2]] and beams.running_scores == [-0.5, -1.5]
    assert beams.num_running == 2 and not beams.is_done


def test_only_candidates_in_the_top_num_beams_finish() -> None:
    """HF keeps 2x candidates as spares: an EOS ranked past num_beams finishes nothing."""
    beams = state(num_return=1, max_new=2)
    spare_eos = cands((0, 1, -0.5), (0, 2, -0.75), (0, EOS, -1.0), (0, 3, -2.0))
    assert beams.step(spare_eos) == [(0, 1), (0, 2)]
    last = cands((0, 4, -1.0), (1, 4, -1.25), (0, EOS, -1.5), (1, EOS, -2.0))
    beams.step(last)
    assert beams.is_done  # max_new_tokens: every ranked candidate finishes
    assert beams.finished() == [([1, 4], -0.5)]  # -1.0 / 2 tokens; [EOS] never finished


def step_2(length_penalty: float, early_stopping: bool | str) -> BeamSearchState:
    """Two steps: [EOS] finished at step 1 (-1.0), [1, EOS] at step 2 (raw -1.5)."""
    beams = state(length_penalty=length_penalty, early_stopping=early_stopping)
    beams.step(STEP_1)
    # Rows: [1] at -0.5 and [2] at -1.5. EOS after [1] ranks 2nd (finishes); after [2], 4th.
    beams.step(cands((0, 4, -1.25), (0, EOS, -1.5), (1, 4, -2.0), (1, EOS, -2.5)))
    return beams


@pytest.mark.parametrize(
    ("length_penalty", "expected"),
    [
        (0.0, [([EOS], -1.0), ([1, EOS], -1.5)]),  # raw sums: the short one wins
        (1.0, [([1, EOS], -0.75), ([EOS], -1.0)]),  # -1.5 / 2: the long one wins
        (2.0, [([1, EOS], -0.375), ([EOS], -1.0)]),  # -1.5 / 4
        (-1.0, [([EOS], -1.0), ([1, EOS], -3.0)]),  # a negative penalty favours short ones
    ],
)
def test_length_penalty_orders_finished_hypotheses(
    length_penalty: float, expected: list[tuple[list[int], float]]
) -> None:
    beams = step_2(length_penalty, early_stopping=True)
    assert beams.is_done  # early_stopping=True: num_beams hypotheses are finished
    assert beams.finished() == expected


def test_early_stopping_modes() -> None:
    # Both slots are finished ([1, EOS] -0.75 and [EOS] -1.0); the best running beam [1, 4]
    # has -1.25, which at its length (2) is -0.625: it could still beat -1.0.
    assert step_2(1.0, True).is_done  # True: stop once num_beams are finished
    assert not step_2(1.0, False).is_done  # False: the heuristic says a beam may still win
    assert not step_2(1.0, "never").is_done


def test_heuristic_stops_when_no_running_beam_can_win() -> None:
    """``False`` judges a beam at its current length, ``"never"`` (with a positive penalty)
    at max_new_tokens, where the same sum is divided by more."""

    def run(early_stopping: bool | str) -> BeamSearchState:
        beams = state(early_stopping=early_stopping, eos=[EOS], max_new=4)
        beams.step(cands((0, 1, -0.5), (0, 2, -0.75), (0, EOS, -1.0), (0, 3, -2.0)))
        # Both EOS rank in the top 2: [1, EOS] -0.75/2 and [2, EOS] -1.0/2 finish.
        beams.step(cands((0, EOS, -0.75), (1, EOS, -1.0), (0, 4, -1.75), (1, 4, -2.0)))
        return beams

    by_now = run(False)  # best running -1.75 / 2 = -0.875 < worst finished -0.5
    assert by_now.is_done and by_now.finished() == [([1, EOS], -0.375), ([2, EOS], -0.5)]
    assert not run("never").is_done  # -1.75 / 4 = -0.4375 > -0.5: it may still win


def test_num_return_sequences_and_max_new_tokens() -> None:
    beams = state(num_beams=3, num_return=2, eos=[], max_new=2)  # ignore_eos: no EOS ids
    assert beams.num_candidates == 6  # at least twice num_beams
    beams.step(cands(*[(0, t, -0.25 * t) for t in range(1, 7)]))
    assert beams.running_token_ids() == [[1], [2], [3]]
    assert not beams.is_done
    last = [(0, 7, -0.5), (1, 7, -0.75), (0, 8, -1.0), (2, 7, -1.25), (1, 9, -3.0), (2, 9, -4.0)]
    beams.step(cands(*last))
    assert beams.is_done  # the budget is spent: every ranked candidate finished
    assert beams.finished() == [([1, 7], -0.25), ([2, 7], -0.375)]  # 2 of 3, by score / 2


def test_exact_ties_are_broken_as_torch_topk_on_a_cpu() -> None:
    """Four equal candidates, two beams: torch's CPU topk keeps the 3rd and 4th (what its
    nth_element leaves); transformers on a CPU runs those beams, so the state does too."""
    beams = state()
    tied = cands(*[(0, token, -0.5) for token in (1, 2, 3, 4)])
    assert beams.step(tied) == [(0, 3), (0, 4)]


@pytest.mark.parametrize(
    ("values", "k", "expected"),
    [
        # Recorded from torch.topk on a CPU (torch 2.13, libstdc++).
        ([1.0] * 4, 2, [2, 3]),
        ([1.0] * 6, 3, [3, 5, 4]),
        ([1.0] * 8, 4, [6, 5, 4, 7]),
        ([1.0] * 12, 4, [9, 7, 8, 6]),
        ([0.0, 1.0, 1.0, 0.0, 1.0, 2.0, 1.0, 0.0], 4, [5, 4, 1, 6]),
        # 64 * k <= n: a heap's partial sort instead, with its own tie order.
        ([1.0] * 63, 1, [41]),
        ([1.0] * 64, 1, [0]),
        ([float(i % 3) for i in range(130)], 2, [5, 2]),
        ([1.0, math.nan, 3.0, -math.inf], 3, [1, 2, 0]),  # NaN counts as the largest
        ([2.0, 1.0], 0, []),
    ],
)
def test_cpu_topk_order(values: list[float], k: int, expected: list[int]) -> None:
    assert topk_indices(values, k) == expected


def test_cpu_topk_order_refuses_k_past_the_values() -> None:
    with pytest.raises(ValueError, match="k=3 out of range for 2 values"):
        topk_indices([1.0, 2.0], 3)


def test_scores_are_float32() -> None:
    assert float32(0.1) == 0.10000000149011612
    assert float32(-1.0e9 - 1.5) == -1.0e9  # float32 steps by 64 there: masked scores tie
    assert float32(1e300) == math.inf and float32(-1e300) == -math.inf
    beams = state(length_penalty=0.5, early_stopping=True, num_return=1, max_new=3)
    beams.step(cands((0, 1, -0.25), (0, 2, -0.5), (0, 3, -0.75), (0, 4, -1.0)))
    raw = float32(-0.6)  # [1, EOS]'s sum, as torch hands it over
    beams.step(cands((0, EOS, raw), (1, EOS, -0.75), (0, 5, -1.0), (1, 5, -1.25)))
    # HF divides by 2 ** 0.5 rounded to float32, in float32: torch's answer on a CPU is
    # -0.4242641031742096, one float32 step away from the rounded float64 quotient.
    ((tokens, score),) = beams.finished()
    assert tokens == [1, EOS] and score == -0.4242641031742096
    assert score == float32(raw / float32(math.sqrt(2))) != float32(raw / math.sqrt(2))


def test_state_contract() -> None:
    """Row counts per step, the min_new_tokens ban, and refusals."""
    beams = state(num_return=1, max_new=2, min_new=1)
    assert beams.num_running == 1 and beams.banned_token_ids() == [EOS]
    with pytest.raises(ValueError, match="expected 4 candidates, got 1"):
        beams.step(STEP_1[:1])
    beams.step(cands((0, 9, -0.5), (0, 8, -1.5), (0, 7, -2.5), (0, 6, -3.5)))
    assert beams.num_running == 2 and beams.banned_token_ids() == []
    beams.step(cands((0, 9, -1.0), (1, 9, -2.0), (0, 8, -2.0), (1, 8, -3.0)))
    assert beams.is_done and beams.finished() == [([9, 9], -0.5)]
    with pytest.raises(RuntimeError, match="beam search is already done"):
        beams.step(STEP_1)
    with pytest.raises(ValueError, match="num_return_sequences <= num_beams"):
        state(num_beams=2, num_return=3)
    with pytest.raises(ValueError, match="early_stopping must be"):
        state(early_stopping="sometimes")
