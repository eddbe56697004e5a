"""Fused CPU kernels of the decoder, a C++ extension built on the machine that runs it.

Its kernels (``cpu_kernels.cpp``) replace chains of small torch ops, and oneDNN's matmul, on
a CPU:

* ``paged_decode_attention``: attention read straight from the paged K/V cache through the
  block tables, one row per query token (decode rows and prefill tokens alike; no gather copy,
  each row reads only its own context, one pass with an online softmax; optionally only the
  last ``window`` positions of it, and with soft-capped scores);
* ``rms_norm`` and ``add_rms_norm``: RMSNorm of the float32 residual stream (after adding a
  layer's output to it), written in the model dtype;
* ``silu_and_mul``: SiLU(gate) * up of the fused gate/up matmul;
* ``gelu_tanh_and_mul``: GELU (tanh approximation)(gate) * up, Gemma's GeGLU;
* ``rope_write_kv``: RoPE on q and k plus the step's K/V cache writes;
* ``refine_logits``: the 16-bit lm_head output widened to float32, each row's best candidates
  recomputed exactly;
* ``bf16_linear``: the bfloat16 matmul of every linear layer, from weights packed once by
  ``pack_bf16_weight`` (vdpbf16ps on AVX512-BF16; elsewhere bf16 widened to float32 in
  registers, a 16-bit shift, so the weights stay at two bytes each in memory);
* ``quant_linear``: the matmul of weights kept quantised (GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K
  repacked by ``quantization.packed_gguf``), dequantised group by group in registers
  (``qgemm.h``; its scalar loops, ``is_scalar=True``, are the reference the tests compare);
  on AVX512-VNNI and AVX2 builds the K-quants and GPTQ g128 tiled by ``lane_tile_codes`` into
  16-row tiles run ``qgemm_lanes.h`` / ``qgemm_lanes_avx2.h`` instead (``is_tiled=True``;
  ``has_lane_tiles``; AVX-512 without VNNI keeps the plain layout).

They compute in float32 (products of bf16 pairs exactly) and round once, so they are at least
as exact as the torch ops they replace, which stay the reference the tests compare them with
and the path on other devices.

The extension is compiled once per ISA level (``cpu_isa.LEVELS``: avx2, avx512, avx512_bf16)
with ``torch.utils.cpp_extension`` (g++, ninja, ``-O3`` and the level's own ``-m`` flags, never
``-march=native``) into a cache folder keyed by the source, torch version and level, and loaded
as a module named after the level, so one process can hold several (the tests compare them).
``make kernels`` runs ``python -m server.continuous_batching.model.cpu_kernels``, which builds
every level this CPU can run; the engine builds its own level on first use if that did not
happen. When it cannot be built (no compiler, say), ``load()`` logs why and returns None, and
the engine runs the torch ops. The generic level has no kernels: torch ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
#: Everything the build reads: the one .cpp and the headers it includes.
SOURCES = sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".cpp", ".h"))
#: Set to "0" to never build or load the extension (the torch ops run instead).
ENV_SWITCH = "LLM_SUITE_CPU_KERNELS"
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
#: The instruction-set flags of each level's build (the generic level builds nothing).
ISA_FLAGS: dict[str, list[str]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
}
#: Longest wait for another process's build of the same folder (a build takes about a minute).
BUILD_TIMEOUT_SECONDS = 600


def build_directory(isa: str) -> Path:
    """Where the ``isa`` build is (or will be): one folder per source (contents and path), torch,
    flags and level."""
    key = hashlib.sha256()
    parts = (
        *(path.read_bytes() for path in SOURCES),
        # ninja's build file names the source's path: two checkouts sharing one folder would
        # rebuild each time the other one built last.
        str(SOURCE.resolve()),
        torch.__version__,
        " ".join(FLAGS + ISA_FLAGS[isa]),
        isa,
    )
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm_suite" / "cpu_kernels" / f"{isa}-{key.hexdigest()[:16]}"


def _build(isa: str, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    folder = build_directory(isa)
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        return _load_locked(cpp_extension, folder, isa, verbose)


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


def _load_locked(cpp_extension: ModuleType, folder: Path, isa: str, verbose: bool) -> ModuleType:
    # ninja may come from the venv's bin folder, which is not on PATH unless activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        name=f"llm_suite_cpu_kernels_{isa}",
        sources=[str(SOURCE)],
        extra_cflags=FLAGS + ISA_FLAGS[isa],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=verbose,
    )


@cache
def load(isa: str, verbose: bool = False) -> ModuleType | None:
    """The kernels compiled for ``isa`` (a ``cpu_isa.LEVELS`` name the CPU can run), building
    them if needed; None for the generic level, and (logged once) when they cannot be built
    or are switched off with ``LLM_SUITE_CPU_KERNELS=0``."""
    if isa not in ISA_FLAGS:
        return None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("fused CPU kernels switched off (%s=0): using torch ops", ENV_SWITCH)
        return None
    try:
        return _build(isa, verbose)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the torch ops
        logger.warning(
            "fused CPU kernels (%s) unavailable (%s: %s); decoding on the CPU runs the slower "
            "torch ops. Build them with: python -m server.continuous_batching.model.cpu_kernels",
            isa,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return None
