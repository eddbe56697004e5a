"""How many device blocks the KV pool gets on cuda when ``cache_config.num_blocks`` is null.

After the model is loaded, the model runner runs the largest step the scheduler can plan
(``batch_max_tokens`` tokens of prefill: ``warmup_steps``) on a temporary pool just big enough,
reads the device's memory figures (``measure_cuda_memory``, the only GPU-only code here), and
gives the real pool what ``gpu_memory_utilization`` of the GPU leaves beside the peak seen
(``num_blocks_from_memory``). On a CPU, ``memory_budget_gb`` sizes the pool instead, capped to
what the machine (or the process's cgroup) has available once the model is loaded, less a
reserve (``cpu_kv_budget``): a pool that does not fit is shrunk with a warning, where zeroing
it would have had the process killed.

Not covered by the warm-up, so left to the headroom that ``gpu_memory_utilization`` < 1 keeps:
the decode CUDA graphs (captured after the pool exists), the sampler's buffers, and the K/V
gathers of the torch attention path over long contexts (the warm-up prefills from position 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

_GIB = 1024**3

#: One warm-up forward: the query length of each sequence and its block table.
WarmupStep = tuple[list[int], list[list[int]]]


@dataclass(frozen=True)
class MemoryFigures:
    """Device memory in bytes, read after the warm-up forward with its temporary pool held."""

    total: int  # the device's memory
    free: int  # free on the device (every process counted)
    reserved: int  # held by torch's caching allocator in this process
    peak_allocated: int  # this process's tensors at their peak over the warm-up
    warmup_pool: int  # the temporary KV pool, part of peak_allocated

    @property
    def outside_torch(self) -> int:
        """Used, but not through torch's allocator: the CUDA context, library workspaces, and
        other processes on the same GPU (counted too: they cannot be told apart here)."""
        return max(0, self.total - self.free - self.reserved)

    @property
    def peak_in_use(self) -> int:
        """What the process needs besides its KV pool: weights, the largest step's
        activations and what lives outside torch's allocator."""
        return self.peak_allocated - self.warmup_pool + self.outside_torch

    def describe(self) -> str:
        """The figures in GiB, for the start-up log."""
        return (
            f"{self.total / _GIB:.2f} GiB total, {self.peak_in_use / _GIB:.2f} GiB in use at "
            f"the warm-up's peak ({self.peak_allocated / _GIB:.2f} GiB of tensors less the "
            f"{self.warmup_pool / _GIB:.2f} GiB warm-up pool, plus "
            f"{self.outside_torch / _GIB:.2f} GiB outside torch)"
        )


def num_blocks_from_memory(
    total_bytes: int, used_bytes: int, utilization: float, bytes_per_block: int
) -> int:
    """Device blocks of the KV pool on cuda: ``(total_bytes * utilization - used_bytes) //
    bytes_per_block``, less the dummy block allocated beside the pool.

    Raises ``ValueError`` naming ``gpu_memory_utilization`` and ``num_blocks`` when not even
    one block fits."""
    budget = int(total_bytes * utilization) - used_bytes
    num_blocks = budget // bytes_per_block - 1
    if num_blocks < 1:
        raise ValueError(
            f"cache_config.gpu_memory_utilization {utilization} of the GPU's "
            f"{total_bytes / _GIB:.2f} GiB leaves {budget / _GIB:.2f} GiB for the KV cache "
            f"after {used_bytes / _GIB:.2f} GiB in use (weights and the peak of a "
            f"batch_max_tokens step), less than two blocks of {bytes_per_block / 2**20:.2f} MiB "
            "(one for the pool, one dummy): raise cache_config.gpu_memory_utilization, lower "
            "batcher_config.batch_max_tokens, or set cache_config.num_blocks"
        )
    return num_blocks


#: What a CPU KV pool leaves free of the memory available after loading (activations, the
#: sampler, the tokenizer's work, the page cache of mapped weights).
CPU_RESERVE_BYTES = 2 * _GIB


def available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process could still take: the kernel's MemAvailable, or less where a cgroup
    (v2) limit is nearer; None where neither can be read."""
    figures = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            figures.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(figures) if figures else None


@dataclass(frozen=True)
class CpuBudget:
    """The CPU KV pool's bytes, and the figures that capped it (for the warning)."""

    num_bytes: int
    asked_bytes: int
    available_bytes: int | None

    @property
    def is_capped(self) -> bool:
        """True when the pool got less than ``memory_budget_gb`` asked for."""
        return self.num_bytes < self.asked_bytes

    def describe(self) -> str:
        """The warning's text."""
        available = (self.available_bytes or 0) / _GIB
        return (
            f"cache_config.memory_budget_gb asks {self.asked_bytes / _GIB:.2f} GiB for the KV "
            f"cache but {available:.2f} GiB is available: the pool gets "
            f"{self.num_bytes / _GIB:.2f} GiB, leaving {CPU_RESERVE_BYTES / _GIB:.0f} GiB free "
            "(lower memory_budget_gb or set cache_config.num_blocks to choose)"
        )


def cpu_kv_budget(asked_bytes: int, available_bytes: int | None, block_bytes: int) -> CpuBudget:
    """``asked_bytes``, capped to ``available_bytes`` less ``CPU_RESERVE_BYTES`` (never under
    one block; unknown availability caps nothing)."""
    if available_bytes is None:
        return CpuBudget(asked_bytes, asked_bytes, None)
    room = max(block_bytes, available_bytes - CPU_RESERVE_BYTES)
    return CpuBudget(min(asked_bytes, room), asked_bytes, available_bytes)


def warmup_query_lens(
    batch_max_tokens: int, batch_max_beams: int, max_seq_len: int
) -> list[list[int]]:
    """Tokens per sequence of the warm-up's prefill steps: the largest step the scheduler can
    plan, as its fewest, longest sequences (the largest attention) and as its most sequences
    (the most logits rows)."""
    num_tokens = min(batch_max_tokens, batch_max_beams * max_seq_len)
    longest = [max_seq_len] * (num_tokens // max_seq_len)
    if num_tokens % max_seq_len:
        longest.append(num_tokens % max_seq_len)
    num_seqs = min(batch_max_beams, num_tokens)
    base, num_longer = divmod(num_tokens, num_seqs)
    most = [base + 1] * num_longer + [base] * (num_seqs - num_longer)
    return [longest] if most == longest else [longest, most]


def warmup_steps(
    batch_max_tokens: int, batch_max_beams: int, max_seq_len: int, block_size: int
) -> list[WarmupStep]:
    """The warm-up forwards: ``warmup_query_lens``, each sequence on consecutive blocks from 0
    (so a step needs ``sum(map(len, block_tables))`` blocks)."""
    steps = []
    for query_lens in warmup_query_lens(batch_max_tokens, batch_max_beams, max_seq_len):
        tables = []
        next_block = 0
        for num_tokens in query_lens:
            num_blocks = -(-num_tokens // block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        steps.append((query_lens, tables))
    return steps


def measure_cuda_memory(
    run_warmup: Callable[[], None], warmup_pool_bytes: int, device: torch.device
) -> MemoryFigures:
    """GPU-ONLY: run the warm-up, then read the device's figures (peak since its start)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_warmup()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemoryFigures(
        total=total,
        free=free,
        reserved=torch.cuda.memory_reserved(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
        warmup_pool=warmup_pool_bytes,
    )
