"""Where what a load converts is kept between starts.

A quantised GGUF costs two conversions at every start: its tensors into the packed layout
(``quantization.packed_cache``) and its embedded vocabulary into a transformers tokenizer
(``engine.gguf_tokenizer``; transformers walks the whole metadata with ``gguf.GGUFReader``:
6-7 s for a 49k vocabulary, several times that for Llama 3's 128k). Both are kept under one
root, keyed by the source file as it is now (path, size, modification time), so a changed
file is converted afresh.

The root: ``model_loading_config.load_cache_dir``, else ``$LLM_SUITE_CACHE_DIR``, else
``$XDG_CACHE_HOME/llm_suite`` (``~/.cache/llm_suite``). A root that cannot be written costs
only the cache (a warning), never the load.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root(configured: str | None = None) -> Path:
    """Where load caches live: ``configured``, else ``$LLM_SUITE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/llm_suite`` (``~/.cache/llm_suite``)."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get("LLM_SUITE_CACHE_DIR"):
        return Path(os.environ["LLM_SUITE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm_suite"


def source_key(source: Path, *extra: str) -> str:
    """A hex key for ``source`` as it is now (path, size, modification time) and ``extra``."""
    stat = source.stat()
    key = hashlib.sha256()
    for part in (str(source.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *extra):
        key.update(part.encode())
        key.update(b"\0")
    return key.hexdigest()[:16]
