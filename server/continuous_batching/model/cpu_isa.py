"""Which CPU path serves: the CPU's features read once, and the kernel ISA chosen from them.

The fused CPU kernels (``cpu_kernels``) are compiled once per ISA level, each with its own
flags (never ``-march=native``, so a build only uses what its level names):

* ``avx512_bf16`` (AVX-512 F/BW/VL/DQ + BF16 + VNNI; AMX CPUs land here): vdpbf16ps on bf16
  pairs, vpdpbusd for quantised weights' batches;
* ``avx512`` (AVX-512 F/BW/VL/DQ): bf16 weights widened to fp32 in registers, 16 lanes;
* ``avx2`` (AVX2 + FMA + F16C): the same, 8 lanes;
* ``generic`` (anything else: older x86, Arm): plain torch ops, slower but correct.

``LLM_SUITE_CPU_ISA`` (or the config's ``cpu_isa``) forces a lower level for testing and
comparison; it is capped at what the CPU has. oneDNN's bfloat16 weight packing is used only
where oneDNN itself says it can run bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and the chosen level is AVX-512 or more: on an AVX2-only
CPU it raises, which used to kill the server at load.

A forced level also caps torch's own kernels in a process that has not run any yet
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``; see :func:`cap_torch_to`), so a server
started with ``LLM_SUITE_CPU_ISA=avx2`` on an AVX-512 machine behaves as on an AVX2 one.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

#: Forces a lower ISA level (capped at the CPU's best); "auto" or unset: the CPU's best.
ENV_ISA = "LLM_SUITE_CPU_ISA"
#: Lowest first.
LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq")
#: The /proc/cpuinfo flags each level needs.
_NEEDS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and 5) has VNNI too.
    "avx512_bf16": (*_AVX512_FLAGS, "avx512_bf16", "avx512_vnni"),
}
#: Words for the log line and /health.
KERNEL_WORDS = {
    "avx512_bf16": "AVX512-BF16 kernels",
    "avx512": "AVX-512 kernels",
    "avx2": "AVX2 kernels",
    "generic": "torch ops",
}
#: What torch's own dispatch (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) are capped
#: to when a level is forced below the CPU's best.
_TORCH_CAPS = {
    "generic": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
}


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers, read once per process (``/proc/cpuinfo`` flags on Linux)."""

    model: str
    machine: str
    flags: frozenset[str]

    @property
    def best_level(self) -> str:
        """The highest ISA level whose instructions this CPU has."""
        if self.machine not in ("x86_64", "AMD64", "i686", "x86"):
            return "generic"
        return [level for level in LEVELS if all(f in self.flags for f in _NEEDS[level])][-1]

    @property
    def has_amx(self) -> bool:
        """AMX tiles with bf16 (Sapphire Rapids and later): served by the avx512_bf16 level."""
        return {"amx_tile", "amx_bf16"} <= self.flags


@lru_cache(maxsize=1)
def probe() -> CpuFeatures:
    """The CPU's model name and feature flags (cached: the CPU does not change)."""
    machine = platform.machine()
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's lines
    model = fields.get("model name") or platform.processor() or machine
    flags = frozenset((fields.get("flags") or fields.get("Features") or "").split())
    if not flags:
        flags = _flags_from_torch()
    return CpuFeatures(model=model, machine=machine, flags=flags)


def _flags_from_torch() -> frozenset[str]:
    """Feature flags implied by torch's own dispatch level, where /proc/cpuinfo is missing."""
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - no torch, or an old one: assume nothing
        return frozenset()
    if capability.startswith("AVX512"):
        return frozenset(_NEEDS["avx512"])
    if capability == "AVX2":
        return frozenset(_NEEDS["avx2"])
    return frozenset()


@dataclass(frozen=True)
class CpuPath:
    """The ISA level the decoder runs at on this CPU, and why."""

    level: str
    best_level: str
    #: How the level was chosen: "auto", or the setting that forced it.
    chosen_by: str
    cpu_model: str
    has_amx: bool

    @property
    def is_forced_lower(self) -> bool:
        """True when a setting put the level below what the CPU has."""
        return LEVELS.index(self.level) < LEVELS.index(self.best_level)

    @property
    def has_kernels(self) -> bool:
        """True when this level has fused kernels to build (every level but generic)."""
        return self.level != "generic"

    def can_pack_onednn_bf16(self) -> bool:
        """oneDNN's prepacked bfloat16 matmul runs here (it raises on AVX2-only CPUs)."""
        if LEVELS.index(self.level) < LEVELS.index("avx512"):
            return False
        import torch

        checker = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(checker is None or checker())

    def describe(self, dtype_name: str, kernels_loaded: bool) -> str:
        """One line for the log and /health, e.g. ``decoder ops: AVX2 kernels, bf16 weights,
        fp32 math (CPU: AMD EPYC, best avx512_bf16; level set by LLM_SUITE_CPU_ISA=avx2)``."""
        weights = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
            dtype_name, dtype_name
        )
        ops = KERNEL_WORDS[self.level] if kernels_loaded else "torch ops"
        if not kernels_loaded and self.has_kernels:
            ops += f" ({self.level} kernels unavailable)"
        amx = " with AMX" if self.has_amx else ""
        cpu = f"CPU: {self.cpu_model}, best {self.best_level}{amx}"
        if self.chosen_by != "auto":
            cpu += f"; level set by {self.chosen_by}"
        return f"decoder ops: {ops}, {weights} weights, fp32 math ({cpu})"


def resolve(requested: str = "auto") -> CpuPath:
    """The level to run: ``requested`` (a config's ``cpu_isa``) unless "auto", else
    ``LLM_SUITE_CPU_ISA``, else the CPU's best; a level above the CPU's is capped, with a
    warning. Raises ValueError for an unknown level name."""
    features = probe()
    best = features.best_level
    chosen_by = "auto"
    level = best
    env_value = os.environ.get(ENV_ISA, "").strip().lower()
    if requested != "auto":
        level, chosen_by = requested, f"cpu_isa={requested}"
    elif env_value not in ("", "auto"):
        level, chosen_by = env_value, f"{ENV_ISA}={env_value}"
    if level not in LEVELS:
        choices = ", ".join(LEVELS)
        raise ValueError(
            f"unknown CPU ISA level {level!r} (from {chosen_by}): choose one of auto, {choices}"
        )
    if LEVELS.index(level) > LEVELS.index(best):
        logger.warning(
            "CPU ISA level %s asked for (%s) but this CPU (%s) has only %s: using %s",
            level,
            chosen_by,
            features.model,
            best,
            best,
        )
        level = best
    return CpuPath(level, best, chosen_by, features.model, features.has_amx)


def cap_torch_to(path: CpuPath) -> None:
    """When ``path`` is forced below the CPU's best, cap torch's own CPU dispatch and oneDNN
    to it too (unless the environment already says), so that the whole process behaves as on
    a CPU of that level. Takes effect only before torch runs its first vectorised kernel and
    oneDNN its first primitive: call it at start-up."""
    if not path.is_forced_lower:
        return
    aten, onednn = _TORCH_CAPS.get(path.level, ("default", "SSE41"))
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
