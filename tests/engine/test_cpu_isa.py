"""The CPU probe and the choice of ISA level, without building or running any kernel: the
levels a CPU's flags allow, what forces a lower one, and when oneDNN's bf16 packing is used."""

from __future__ import annotations

import pytest
import torch

from server.continuous_batching.model import cpu_isa
from server.continuous_batching.model.cpu_isa import CpuFeatures, CpuPath
from server.continuous_batching.model.linear import choose_packing

EPYC_AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"  # no avx512 at all
SKYLAKE_X = EPYC_AVX2 + " avx512f avx512cd avx512bw avx512dq avx512vl"
SAPPHIRE_RAPIDS = SKYLAKE_X + " avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
CPU = torch.device("cpu")


def features(flags: str, machine: str = "x86_64") -> CpuFeatures:
    return CpuFeatures(model="test CPU", machine=machine, flags=frozenset(flags.split()))


@pytest.mark.parametrize(
    "flags,machine,best",
    [
        (EPYC_AVX2, "x86_64", "avx2"),
        (SKYLAKE_X, "x86_64", "avx512"),
        (SAPPHIRE_RAPIDS, "x86_64", "avx512_bf16"),
        # The avx512_bf16 build multiplies quantised batches with VNNI (qgemm_vnni.h).
        (SKYLAKE_X + " avx512_bf16", "x86_64", "avx512"),
        ("fpu sse sse2 avx", "x86_64", "generic"),  # AVX without AVX2
        ("avx2 fma", "x86_64", "generic"),  # no F16C: the AVX2 build's flags need it
        ("fp asimd bf16 sve", "aarch64", "generic"),  # Arm: torch ops
    ],
)
def test_best_level_from_the_flags(flags: str, machine: str, best: str) -> None:
    assert features(flags, machine).best_level == best


def test_amx_is_served_by_the_bf16_kernels() -> None:
    cpu = features(SAPPHIRE_RAPIDS)
    assert cpu.has_amx and cpu.best_level == "avx512_bf16"


def test_this_machine_is_probed_once() -> None:
    first = cpu_isa.probe()
    assert first is cpu_isa.probe() and first.best_level in cpu_isa.LEVELS
    assert first.model


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend the machine has the given flags (the probe is the only source of them)."""

    def use(flags: str) -> None:
        monkeypatch.setattr(cpu_isa, "probe", lambda: features(flags))

    monkeypatch.delenv(cpu_isa.ENV_ISA, raising=False)
    return use


def test_auto_is_the_best_and_settings_force_lower(on_cpu, monkeypatch) -> None:
    on_cpu(SAPPHIRE_RAPIDS)
    assert cpu_isa.resolve().level == "avx512_bf16" and not cpu_isa.resolve().is_forced_lower
    monkeypatch.setenv(cpu_isa.ENV_ISA, "AVX2")
    path = cpu_isa.resolve()
    assert path.level == "avx2" and path.is_forced_lower
    assert path.chosen_by == "LLM_SUITE_CPU_ISA=avx2"
    # The config's cpu_isa wins over the environment.
    assert cpu_isa.resolve("generic").level == "generic"
    assert cpu_isa.resolve("generic").chosen_by == "cpu_isa=generic"


def test_a_level_above_the_cpu_is_capped_with_a_warning(on_cpu, caplog) -> None:
    on_cpu(EPYC_AVX2)
    path = cpu_isa.resolve("avx512_bf16")
    assert path.level == "avx2" and not path.is_forced_lower
    assert "has only avx2" in caplog.text


def test_an_unknown_level_is_refused_by_name(on_cpu, monkeypatch) -> None:
    on_cpu(EPYC_AVX2)
    monkeypatch.setenv(cpu_isa.ENV_ISA, "avx3")
    with pytest.raises(ValueError, match=r"'avx3' \(from LLM_SUITE_CPU_ISA=avx3\).*avx2"):
        cpu_isa.resolve()


def test_the_line_says_what_serves(on_cpu, monkeypatch) -> None:
    on_cpu(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(cpu_isa.ENV_ISA, "avx2")
    line = cpu_isa.resolve().describe("bfloat16", kernels_loaded=True)
    assert line == (
        "decoder ops: AVX2 kernels, bf16 weights, fp32 math (CPU: test CPU, best avx512_bf16 "
        "with AMX; level set by LLM_SUITE_CPU_ISA=avx2)"
    )
    broken = cpu_isa.resolve().describe("bfloat16", kernels_loaded=False)
    assert broken.startswith("decoder ops: torch ops (avx2 kernels unavailable), bf16 weights")


def test_forcing_caps_torch_and_onednn_unless_already_set(on_cpu, monkeypatch) -> None:
    on_cpu(SAPPHIRE_RAPIDS)
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    cpu_isa.cap_torch_to(cpu_isa.resolve())  # auto: nothing to cap
    assert "ATEN_CPU_CAPABILITY" not in cpu_isa.os.environ
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # the user's own cap stays
    cpu_isa.cap_torch_to(cpu_isa.resolve("avx2"))
    assert cpu_isa.os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert cpu_isa.os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"


def test_onednn_bf16_packing_never_below_avx512() -> None:
    # On an AVX2-only CPU oneDNN's bf16 reorder raises: the packing choice must not ask it.
    avx2 = CpuPath("avx2", "avx2", "auto", "EPYC", False)
    generic = CpuPath("generic", "avx512_bf16", "cpu_isa=generic", "EPYC", False)
    for path in (avx2, generic):
        assert not path.can_pack_onednn_bf16()
        assert choose_packing(CPU, torch.bfloat16, path, kernels=None) == "none"
    assert choose_packing(CPU, torch.float32, avx2, kernels=None) == "onednn"
    assert choose_packing(torch.device("cuda"), torch.bfloat16, avx2, kernels=None) == "none"
