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


class HealthResponse(BaseModel):
    """Answer of ``GET /health``: liveness, what is served, and the load."""

    status: Literal["ok", "loading", "degraded"] = "ok"
    kind: ServerKind
    model: str | None = None
    max_model_len: int | None = None
    load: LoadReport = LoadReport()
