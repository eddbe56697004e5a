"""Weights and KV cache on 2 MiB pages on a CPU.

A decode step streams every weight once; on 4 KiB pages that is one TLB entry per 4 KiB, and
the quantised matmuls ran 1.5x slower in about half of all processes on this project's CPU
(benchmarks/quant_matmul.py's layers: 1.1-1.2 ms against 1.7-2.0 ms, depending only on where
the process's pages landed). Torch's CPU allocator puts allocations of 2 MiB and more on
transparent huge pages (2 MiB-aligned, ``madvise(MADV_HUGEPAGE)``) when
``THP_MEM_ALLOC_ENABLE=1``; with it every run took the fast path.

Torch reads the variable at the process's first allocation of 2 MiB or more, so this is
called before the model loads. A value the user set is kept (``THP_MEM_ALLOC_ENABLE=0`` turns
it off); the kernel's own setting (``/sys/kernel/mm/transparent_hugepage/enabled``:
``never``) still wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Torch's switch for huge-page CPU allocations.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def request_huge_pages() -> bool:
    """Ask torch for huge-page allocations unless the user decided; True when they are on."""
    if not sys.platform.startswith("linux"):
        return False
    os.environ.setdefault(THP_ENV, "1")
    return os.environ[THP_ENV] == "1"


def huge_page_mib(smaps: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """MiB of this process's anonymous memory on huge pages (None where Linux does not say)."""
    try:
        for line in smaps.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
