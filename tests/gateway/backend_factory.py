"""Backends of each kind built in code, already healthy, for tests of the gateway's parts."""

from __future__ import annotations

from client.backends.backend import Backend
from client.backends.kinds.openai_compatible import OpenAICompatibleUpstream
from client.backends.kinds.openai_compatible_config import OpenAIJumperConfig
from client.config.kinds import KINDS
from protocol.health import LoadReport

_KIND_CLASSES = {kind.kind: kind for kind in KINDS}


def healthy_server(url: str, kind: str, model_ids: list[str], **load: int) -> Backend:
    """A healthy server of ``kind`` at ``url`` serving ``model_ids`` with the reported ``load``."""
    backend = _KIND_CLASSES[kind](url=url)  # type: ignore[call-arg]
    backend.health.is_healthy = True
    backend.health.model_ids = list(model_ids)
    backend.health.load = LoadReport(**load)
    return backend


def jumper(config: OpenAIJumperConfig, index: int = 0) -> OpenAICompatibleUpstream:
    """The fallback-tier upstream of one ``openai_jumper_configs`` entry at position ``index``."""
    entry = config.upstream_config()
    return OpenAICompatibleUpstream(url=entry.url, config=entry, index=index)
