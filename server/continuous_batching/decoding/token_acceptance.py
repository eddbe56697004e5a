"""The token rules that need no text: which ids may be chosen, and what a chosen one ends.

Before a step, :func:`row_params_for` gives a sequence's row parameters, with its stop ids
banned while fewer than ``min_new_tokens`` tokens were generated (HF's
``MinNewTokensLengthLogitsProcessor``). After it, :func:`append_token` adds the chosen token
and ends the sequence on a stop id (``"stop"``), when its output grammar is complete
(structured output: ``"stop"``) or at ``max_new_tokens`` (``"length"``); stop strings need the
text and are applied by :mod:`server.continuous_batching.decoding.text_deltas`.

Plain Python over sequences and the block manager: no tensors.
"""

from __future__ import annotations

from protocol.generation import GenerationConfig
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.sequence import Sequence, SequenceGroup

__all__ = ["append_token", "row_params_for", "stop_token_ids_for"]


def stop_token_ids_for(config: GenerationConfig, eos_token_ids: list[int]) -> list[int]:
    """The ids that end a request's sequences: the model's EOS ids (unless ``ignore_eos``),
    then the request's own ``stop_token_ids``."""
    eos = [] if config.ignore_eos else eos_token_ids
    return [*eos, *config.stop_token_ids]


def row_params_for(group: SequenceGroup, seq: Sequence) -> RowParams:
    """``seq``'s row parameters: built on its first step, then only the ban changes.

    They are kept on the sequence rather than rebuilt every step: what changes later is only
    the ban, lifted once ``min_new_tokens`` tokens were generated, and the penalty's token
    list, which is the sequence's own live list.
    """
    row = seq.row_params
    is_min_reached = seq.num_generated >= group.config.min_new_tokens
    if row is None:
        row = seq.row_params = RowParams.from_generation_config(
            group.config,
            generator=group.generator,
            banned_token_ids=None if is_min_reached else group.stop_token_ids,
            # The live token list: the penalties follow the sequence as it grows.
            penalty_token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            bad_words_ids=group.bad_words_ids,
        )
        row.grammar = seq.grammar  # the sequence's own matcher: the sampler masks by it
    elif row.banned_token_ids and is_min_reached:
        row.banned_token_ids = []  # min_new_tokens reached: stop ids are allowed from now on
    return row


def append_token(
    group: SequenceGroup, seq: Sequence, token: int, block_manager: BlockManager
) -> None:
    """Add ``token`` to ``seq`` and apply the stop rules that need no text (stop ids,
    ``max_new_tokens``); a sequence that ends gives its blocks back now.

    A stop id wins over the length when both apply: the request asked to stop there.
    """
    seq.token_ids.append(token)
    grammar = seq.grammar
    if token in group.stop_token_ids:
        seq.finish_reason = "stop"
    elif grammar is not None and (not grammar.accept(token) or grammar.is_finished):
        # Complete (nothing may follow): done. A token the grammar refuses cannot be drawn
        # from a masked row; should it happen anyway, the output ends rather than goes wrong.
        seq.finish_reason = "stop"
    elif seq.num_generated >= (group.config.max_new_tokens or 0):
        seq.finish_reason = "length"
    if seq.is_finished:
        block_manager.free(seq)
