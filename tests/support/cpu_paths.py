"""The CPU ISA levels this machine can run (``cpu_isa.LEVELS`` up to its best): the tests run
every one of them, so an AVX-512 machine checks the AVX2 path too (forced, with kernels
compiled for it alone)."""

from __future__ import annotations

from types import ModuleType

import pytest

from server.continuous_batching.model import cpu_isa, cpu_kernels


def runnable_levels() -> list[str]:
    """Every level up to this CPU's best, lowest first ("generic": torch ops)."""
    best = cpu_isa.probe().best_level
    return list(cpu_isa.LEVELS[: cpu_isa.LEVELS.index(best) + 1])


def kernel_levels() -> list[str]:
    """The runnable levels that have fused kernels (all but generic)."""
    return [level for level in runnable_levels() if level in cpu_kernels.ISA_FLAGS]


def built_kernels(level: str) -> ModuleType:
    """The fused kernels of ``level``, built if need be; the test fails when they cannot be."""
    module = cpu_kernels.load(level)
    if module is None:
        pytest.fail(f"the fused CPU kernels ({level}) could not be built (see the log)")
    return module
