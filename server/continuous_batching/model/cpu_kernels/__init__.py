"""Fused CPU kernels of the decoder, a C++ extension built on the machine that runs it.

Its kernels (``cpu_kernels.cpp``) replace chains of small torch ops, and oneDNN's matmul, on
a CPU:

* ``paged_decode_attention``: attention read straight from the paged K/V cache through the
  block tables, one row per query token (decode rows and prefill tokens alike; no gather copy,
  each row reads only its own context, one pass with an online softmax);
* ``rms_norm`` and ``add_rms_norm``: RMSNorm of the float32 residual stream (after adding a
  layer's output to it), written in the model dtype;
* ``silu_and_mul``: SiLU(gate) * up of the fused gate/up matmul;
* ``rope_write_kv``: RoPE on q and k plus the step's K/V cache writes;
* ``refine_logits``: the 16-bit lm_head output widened to float32, each row's best candidates
  recomputed exactly;
* ``bf16_linear`` (CPUs with AVX512-BF16): the bfloat16 matmul of every linear layer, from
  weights packed once by ``pack_bf16_weight``.

They compute in float32 (products of bf16 pairs exactly) and round once, so they are at least
as exact as the torch ops they replace, which stay the reference the tests compare them with
and the path on other devices.

The extension is compiled with ``torch.utils.cpp_extension`` (g++, ninja, ``-O3
-march=native``) into a cache folder keyed by the source, torch version and CPU, so a machine
builds it once: ``make venv`` runs ``python -m server.continuous_batching.model.cpu_kernels``
and the engine builds it on first use if that did not happen. When it cannot be built (no
compiler, say), ``load()`` logs why and returns None, and the engine runs the torch ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
#: Set to "0" to never build or load the extension (the torch ops run instead).
ENV_SWITCH = "LLM_SUITE_CPU_KERNELS"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
#: Longest wait for another process's build of the same folder (a build takes about a minute).
BUILD_TIMEOUT_SECONDS = 600


def _cpu_signature() -> str:
    """The CPU's model and feature flags: -march=native code must not move to another CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if ":" in line}
    return "\n".join(lines.get(key, "") for key in wanted)


def build_directory() -> Path:
    """Where the extension is (or will be) built: one folder per source, torch and CPU."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm_suite" / "cpu_kernels" / key.hexdigest()[:16]


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        return _load_locked(cpp_extension, folder, verbose)


@contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """One builder per folder across processes, released by the kernel if its holder dies.

    cpp_extension's own lock is a plain file that a process killed mid-build leaves behind,
    after which every later load would wait for it forever. Holding this flock proves nobody
    else is building, so a leftover file of cpp_extension's is stale and removed."""
    with open(folder / "build.flock", "w") as handle:
        deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    message = f"another process has been building {folder} too long"
                    raise TimeoutError(message) from None
                time.sleep(0.5)  # a build takes about a minute: no finer wait is worth it
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_locked(cpp_extension: ModuleType, folder: Path, verbose: bool) -> ModuleType:
    # ninja may come from the venv's bin folder, which is not on PATH unless activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        name="llm_suite_cpu_kernels",
        sources=[str(SOURCE)],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=verbose,
    )


@lru_cache(maxsize=1)
def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, building them if needed; None (logged once) when they cannot be
    built or are switched off with ``LLM_SUITE_CPU_KERNELS=0``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("fused CPU kernels switched off (%s=0): using torch ops", ENV_SWITCH)
        return None
    try:
        return _build(verbose)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the torch ops
        logger.warning(
            "fused CPU kernels unavailable (%s: %s); decoding on the CPU runs the slower torch "
            "ops. Build them with: python -m server.continuous_batching.model.cpu_kernels",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return None
