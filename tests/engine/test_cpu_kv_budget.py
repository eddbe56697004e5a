"""The CPU KV pool is sized by ``memory_budget_gb`` but never past what the machine (or the
process's cgroup) has available after loading, less a reserve: a budget that does not fit
shrinks the pool with a warning instead of getting the server killed while zeroing it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from server.continuous_batching.model import kv_bytes_per_block
from server.continuous_batching.runner import model_runner as model_runner_module
from server.continuous_batching.runner.kv_memory import (
    CPU_RESERVE_BYTES,
    available_memory,
    cpu_kv_budget,
)
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config

GIB = 1 << 30


def test_budget_capped_to_what_is_available() -> None:
    fits = cpu_kv_budget(2 * GIB, 16 * GIB, 1 << 20)
    assert fits.num_bytes == 2 * GIB and not fits.is_capped
    capped = cpu_kv_budget(8 * GIB, 5 * GIB, 1 << 20)
    assert capped.num_bytes == 5 * GIB - CPU_RESERVE_BYTES and capped.is_capped
    assert "asks 8.00 GiB" in capped.describe() and "5.00 GiB is available" in capped.describe()
    assert cpu_kv_budget(8 * GIB, GIB, 1 << 20).num_bytes == 1 << 20  # one block at least
    assert cpu_kv_budget(8 * GIB, None, 1 << 20).num_bytes == 8 * GIB  # unknown: as asked


def test_available_memory_reads_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8388608 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 8 * GIB  # no cgroup files: the machine's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert available_memory(meminfo, cgroup) == 8 * GIB
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    assert available_memory(meminfo, cgroup) == 3 * GIB  # the cgroup's limit is nearer
    assert available_memory(tmp_path / "none", tmp_path / "none") is None
    assert (available_memory() or 0) > 0  # this machine's own figures


def test_runner_shrinks_a_pool_that_does_not_fit(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    available = CPU_RESERVE_BYTES + GIB // 2
    monkeypatch.setattr(model_runner_module, "available_memory", lambda: available)
    config = engine_config(default_model_path, num_blocks=None, num_blocks_cpu=0)
    config.cache_config.memory_budget_gb = 64.0
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(config)
    block = kv_bytes_per_block(runner.arch, runner.block_size, runner.dtype)
    assert runner.num_blocks == (GIB // 2) // block
    assert "memory_budget_gb asks 64.00 GiB" in caplog.text
