"""The health and load report every server answers on ``GET /health``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

ServerKind = Literal["static_batching", "continuous_batching", "embedding", "gateway"]


class LoadReport(BaseModel):
    """How busy a server is; the gateway balances on these numbers."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_kv_blocks_free: int | None = None
    num_kv_blocks_total: int | None = None
    num_cpu_kv_blocks_free: int | None = None
    num_cpu_kv_blocks_total: int | None = None


class ComputePath(BaseModel):
    """What computes a model server's forward: the device and, on a CPU, the ISA level the
    kernels were chosen for (the log line at start-up says the same)."""

    device: str
    #: The CPU ISA level serving (generic, avx2, avx512, avx512_bf16); None off the CPU.
    isa: str | None = None
    #: The best level this CPU has (isa is lower when a setting forced it).
    best_isa: str | None = None
    #: What runs the decoder, e.g. "fused CPU kernels (avx2)", "torch".
    decoder_ops: str
    #: One line for people: "decoder ops: AVX2 kernels, bf16 weights, fp32 math (CPU: ...)".
    summary: str
    #: How the matmul weights are held, e.g. "gguf Q4_K (packed int4, avx2)"; None where the
    #: server does not say (optional: older servers and clients leave it out).
    weights: str | None = None


class HealthResponse(BaseModel):
    """Answer of ``GET /health``: liveness, what is served, and the load."""

    status: Literal["ok", "loading", "degraded"] = "ok"
    kind: ServerKind
    model: str | None = None
    max_model_len: int | None = None
    load: LoadReport = LoadReport()
    #: What computes the model (CB servers); None where the server does not say.
    compute: ComputePath | None = None
