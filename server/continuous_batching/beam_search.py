"""Per-request beam search state reproducing transformers 5's ``GenerationMixin._beam_search``.

The engine owns the model calls and the KV cache; this class owns the beam bookkeeping. Each
step the engine hands over the processed log-probs of the request's running rows and gets back
which row each new beam continues and with which token, best first, so it can fork the block
tables (copy-on-write) and append the tokens.

To reproduce HF bit for bit, the state keeps the same tensors (with a batch dimension of 1)
and performs the same torch ops in the same order: the candidate ``topk`` over the flattened
``[num_beams * V]`` scores, the ``-1e9`` masking of finished candidates, the merge of new
hypotheses into the finished set with a second ``topk``, the early-stop heuristic and the
done test. Tie-breaking therefore matches HF's as well. HF's static-shaped sequence buffers
become ``[num_beams, max_new_tokens]`` buffers of generated ids plus a length per hypothesis.

Logits processing is the caller's job, done as HF does it (see
:func:`server.continuous_batching.sampler.beam_log_probs`): ``log_softmax`` of the raw logits,
then the repetition penalty and, while fewer than ``min_new_tokens`` tokens were generated,
``-inf`` on the EOS ids (:meth:`BeamSearchState.banned_token_ids` says which), like HF's
``MinNewTokensLengthLogitsProcessor``.
"""

from __future__ import annotations

import torch

# HF's "minus infinity" for beam scores: large but finite, so masked scores still order.
_NEG = -1.0e9


class BeamSearchState:
    """Beam search over one request's beams (HF semantics for every parameter).

    Args:
        num_beams: beams kept alive each step.
        num_return_sequences: how many finished hypotheses :meth:`finished` returns.
        length_penalty: finished scores are divided by ``generated_len ** length_penalty``.
        early_stopping: ``True`` stops once ``num_beams`` hypotheses are finished; ``False``
            stops when the heuristic says no running beam can beat the worst finished one;
            ``"never"`` uses the best score a beam could still reach (HF's canonical variant).
        eos_token_ids: ids that end a hypothesis; empty for ``ignore_eos``.
        num_prompt_tokens: prompt length (only differences of lengths matter).
        max_new_tokens: generation budget; reaching it finishes every candidate.
        min_new_tokens: EOS is banned (by the caller) until this many tokens were generated.
    """

    def __init__(
        self,
        num_beams: int,
        num_return_sequences: int,
        length_penalty: float,
        early_stopping: bool | str,
        eos_token_ids: list[int],
        num_prompt_tokens: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
    ) -> None:
        if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
            raise ValueError("need 1 <= num_return_sequences <= num_beams")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never': {early_stopping!r}")
        self.num_beams = num_beams
        self.num_return_sequences = num_return_sequences
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = list(eos_token_ids)
        self.min_new_tokens = min_new_tokens
        self.max_new_tokens = max_new_tokens
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long)
        # HF keeps (1 + n_eos) * num_beams candidates (at least 2x) so that num_beams of them
        # are still running even if the best ones all end with an EOS.
        self._beams_to_keep = max(2, 1 + len(self.eos_token_ids)) * num_beams
        self._top_num_beam_mask = torch.zeros(self._beams_to_keep, dtype=torch.bool)
        self._top_num_beam_mask[:num_beams] = True
        # HF's cur_len / decoder_prompt_len / max_length, kept so the float arithmetic of the
        # length penalty and the heuristic is literally HF's.
        self._prompt_len = num_prompt_tokens
        self._cur_len = num_prompt_tokens
        self._max_length = num_prompt_tokens + max_new_tokens

        shape = (1, num_beams, max_new_tokens)
        self._running = torch.full(shape, -1, dtype=torch.long)
        self._finished = torch.full(shape, -1, dtype=torch.long)
        self._finished_lengths = torch.zeros((1, num_beams), dtype=torch.long)
        # Only beam 0 is live at first, so the first step expands the prompt once, not B times.
        self._running_scores = torch.zeros((1, num_beams), dtype=torch.float)
        self._running_scores[:, 1:] = _NEG
        self._finished_scores = torch.full((1, num_beams), _NEG, dtype=torch.float)
        self._is_sent_finished = torch.zeros((1, num_beams), dtype=torch.bool)
        self._heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.is_done = False

    @property
    def num_generated(self) -> int:
        """Tokens generated so far by every running beam."""
        return self._cur_len - self._prompt_len

    @property
    def num_running(self) -> int:
        """Rows the next :meth:`step` expects: 1 (the prompt) at first, then ``num_beams``."""
        return 1 if self.num_generated == 0 else self.num_beams

    def banned_token_ids(self) -> list[int]:
        """Ids to score ``-inf`` this step: the EOS ids while under ``min_new_tokens``."""
        return list(self.eos_token_ids) if self.num_generated < self.min_new_tokens else []

    def running_token_ids(self) -> list[list[int]]:
        """Generated ids of each running beam (row order of the next :meth:`step`)."""
        rows = self._running[0, : self.num_running, : self.num_generated]
        return rows.tolist()

    def step(self, log_probs: torch.Tensor) -> list[tuple[int, int]]:
        """Advance one token.

        Args:
            log_probs: ``[num_running, V]`` processed log-probs of the running rows.

        Returns:
            The new running beams as ``(parent_row, token_id)``, best first (``num_beams``).
            Meaningless once :attr:`is_done` turns true, which the caller must check.
        """
        if self.is_done:
            raise RuntimeError("beam search is already done")
        if log_probs.dim() != 2 or log_probs.shape[0] != self.num_running:
            raise ValueError(f"expected [{self.num_running}, V] log-probs, got {log_probs.shape}")
        num_beams, generated = self.num_beams, self.num_generated
        log_probs = log_probs.to(dtype=torch.float32)
        if log_probs.device != self._running.device:
            self._move_to(log_probs.device)
        if generated == 0:
            # HF runs num_beams copies of the prompt; copies 1.. carry -1e9 and lose.
            log_probs = log_probs.expand(num_beams, -1)
        vocab_size = log_probs.shape[-1]

        # c. top-K continuations over all beams (HF's _get_top_k_continuations).
        accumulated = log_probs[None] + self._running_scores[:, :, None]
        accumulated = torch.reshape(accumulated, (1, -1))
        topk_log_probs, topk_indices = torch.topk(accumulated, k=self._beams_to_keep)
        topk_parents = topk_indices // vocab_size
        topk_ids = topk_indices % vocab_size
        topk_running = torch.take_along_dim(self._running, topk_parents[..., None], dim=1)
        topk_running[:, :, generated] = topk_ids

        # d. stopping criteria per candidate: max length (all of them) or an EOS id.
        hits = torch.zeros((1, self._beams_to_keep), dtype=torch.bool, device=topk_ids.device)
        if self._cur_len + 1 >= self._max_length:
            hits |= True
        if self.eos_token_ids:
            hits |= torch.isin(topk_ids, self._eos)

        # e. the best num_beams unfinished candidates keep running.
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_indices = torch.topk(topk_running_log_probs, k=num_beams)[1]
        self._running = torch.take_along_dim(topk_running, next_indices[..., None], dim=1)
        self._running_scores = torch.take_along_dim(topk_running_log_probs, next_indices, dim=1)
        parents = torch.take_along_dim(topk_parents, next_indices, dim=1)[0]
        tokens = torch.take_along_dim(topk_ids, next_indices, dim=1)[0]

        self._update_finished(topk_running, topk_log_probs, hits)
        self._cur_len += 1
        self._update_done(hits)
        # The first step's parents all copy the single prompt row.
        parent_rows = [0] * num_beams if generated == 0 else parents.tolist()
        return list(zip(parent_rows, tokens.tolist(), strict=True))

    def _move_to(self, device: torch.device) -> None:
        """Keep the (small) state tensors where the log-probs live: no host copy of [B, V]."""
        for name in (
            "_eos",
            "_top_num_beam_mask",
            "_running",
            "_finished",
            "_finished_lengths",
            "_running_scores",
            "_finished_scores",
            "_is_sent_finished",
            "_heuristic_unsatisfied",
        ):
            setattr(self, name, getattr(self, name).to(device))

    def _update_finished(
        self, topk_running: torch.Tensor, topk_log_probs: torch.Tensor, hits: torch.Tensor
    ) -> None:
        """f. merge new hypotheses into the finished set (HF's ``_update_finished_beams``)."""
        # Only candidates ranked in the top num_beams may finish; the rest are spares.
        just_finished = hits & self._top_num_beam_mask[None, :]
        scores = topk_log_probs / ((self._cur_len + 1 - self._prompt_len) ** self.length_penalty)
        full = torch.all(self._is_sent_finished, dim=-1, keepdim=True) & (
            self.early_stopping is True
        )
        scores += full.to(torch.float32) * _NEG
        scores += (~self._heuristic_unsatisfied).to(torch.float32) * _NEG
        scores += (~just_finished) * _NEG

        lengths = torch.full_like(hits, self.num_generated + 1, dtype=torch.long)
        merged_scores = torch.cat((self._finished_scores, scores), dim=1)
        keep = torch.topk(merged_scores, k=self.num_beams)[1]
        merged = torch.cat((self._finished, topk_running), dim=1)
        merged_lengths = torch.cat((self._finished_lengths, lengths), dim=1)
        merged_is_finished = torch.cat((self._is_sent_finished, just_finished), dim=1)
        self._finished = torch.take_along_dim(merged, keep[..., None], dim=1)
        self._finished_scores = torch.take_along_dim(merged_scores, keep, dim=1)
        self._finished_lengths = torch.take_along_dim(merged_lengths, keep, dim=1)
        self._is_sent_finished = torch.take_along_dim(merged_is_finished, keep, dim=1)

    def _update_done(self, hits: torch.Tensor) -> None:
        """g. update the early-stop heuristic, then decide whether the search is done.

        HF's ``_check_early_stop_heuristic`` followed by ``_beam_search_has_unfinished_sequences``.
        """
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            # A positive penalty favours length: the best a beam can do is at max length.
            best_hypothetical_length = self._max_length - self._prompt_len
        else:
            best_hypothetical_length = self._cur_len - self._prompt_len
        best_possible_running_score = self._running_scores[:, :1] / (
            best_hypothetical_length**self.length_penalty
        )
        worst_finished_score = torch.where(
            self._is_sent_finished,
            torch.min(self._finished_scores, dim=1, keepdim=True)[0],
            _NEG,
        )
        self._heuristic_unsatisfied = self._heuristic_unsatisfied & torch.any(
            best_possible_running_score > worst_finished_score, dim=-1, keepdim=True
        )
        improvement_possible = bool(torch.any(self._heuristic_unsatisfied))
        all_finished = bool(torch.all(self._is_sent_finished))
        exists_open_beam = not (all_finished and self.early_stopping is True)
        valid_continuations = not bool(torch.all(hits))
        self.is_done = not (improvement_possible and exists_open_beam and valid_continuations)

    def finished(self) -> list[tuple[list[int], float]]:
        """The ``num_return_sequences`` best hypotheses, best first: (generated ids, score).

        Ids include the EOS the hypothesis ended with. Scores are HF's ``sequences_scores``
        (sum of log-probs divided by ``generated_len ** length_penalty``). A slot that never
        received a hypothesis (HF returns the prompt padded) comes back as ``([], -1e9)``.
        """
        out = []
        for i in range(self.num_return_sequences):
            length = int(self._finished_lengths[0, i])
            tokens = self._finished[0, i, :length].tolist()
            out.append((tokens, float(self._finished_scores[0, i])))
        return out
