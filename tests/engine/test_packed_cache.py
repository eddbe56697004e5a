"""The packed-weight cache (``quantization.packed_cache``): a quantised GGUF repacked once, its
packed form memory-mapped at later loads (bit for bit what repacking gives), a changed file
or a damaged entry repacked afresh, and a cache that cannot be written costing nothing but the
cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model import weights_gguf_packed
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.quantization import packed_cache
from server.continuous_batching.quantization.packed_cache import PackedCache
from server.continuous_batching.quantization.packed_linear import ConcatLinear, PackedLinear
from tests.support.cpu_paths import kernel_levels
from tests.support.gguf_files import write_tiny_llama

pytestmark = pytest.mark.skipif(not kernel_levels(), reason="no fused CPU kernels on this CPU")

#: Q4_K_M's mix: Q4_K, with Q6_K v, down and lm_head.
MIX = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}


def _load(path: Path, root: Path, is_cached: bool = True):
    config = ModelLoadingConfig(
        model_name_or_path=str(path),
        torch_dtype="float32",
        load_cache_dir=str(root),
        cache_packed_weights=is_cached,
    )
    return load_model(config)[0]


def _packed(model) -> list[torch.Tensor]:
    """Every tensor of every packed weight, in model order."""
    linears = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o_proj", "gate_up")]
    linears += [layer.down for layer in model.layers] + [model.lm_head_linear]
    tensors = []
    for linear in linears:
        parts = linear.parts if isinstance(linear, ConcatLinear) else [linear]
        assert all(isinstance(p, PackedLinear) for p in parts)
        tensors += [t for p in parts for t in p.weight.tensors() if t is not None]
    return tensors


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "packed").iterdir() if p.is_dir())


def _no_repacking(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("repacked although the cache holds the weights")

    monkeypatch.setattr(weights_gguf_packed, "repack", refuse)


def test_second_load_maps_the_first_ones_packing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_tiny_llama(tmp_path / "mix.gguf", MIX, T.Q4_K, is_tied=False)
    root = tmp_path / "cache"
    cold = _load(gguf, root)
    (entry,) = _entries(root)
    assert (entry / "index.json").is_file() and PackedCache(gguf, root).is_hit
    with monkeypatch.context() as patch:
        _no_repacking(patch)
        warm = _load(gguf, root)
    ids = torch.tensor([5, 17, 99, 3])
    for a, b in zip(_packed(cold), _packed(warm), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for layer_cold, layer_warm in zip(cold.layers, warm.layers, strict=True):
        x = torch.randn(len(ids), cold.config.hidden_size)
        assert torch.equal(layer_cold.gate_up(x), layer_warm.gate_up(x))
    assert _entries(root) == [entry]


def test_a_changed_or_deleted_file_leaves_no_stale_entry(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "m.gguf", MIX, T.Q4_K, seed=1)
    root = tmp_path / "cache"
    _load(gguf, root)
    (old,) = _entries(root)
    write_tiny_llama(gguf, MIX, T.Q4_K, seed=2)  # same path, new weights
    os.utime(gguf, ns=(1, 1))  # a different modification time, whatever the clock says
    fresh = _load(gguf, root)
    (new,) = _entries(root)
    assert new != old
    # A file that is gone leaves nothing behind once another entry is written.
    gone = write_tiny_llama(tmp_path / "gone.gguf", MIX, T.Q4_K, seed=3)
    _load(gone, root)
    assert len(_entries(root)) == 2
    gone.unlink()
    other = write_tiny_llama(tmp_path / "other.gguf", MIX, T.Q4_K, seed=4)
    _load(other, root)
    assert {e.name.rsplit("-", 1)[0] for e in _entries(root)} == {"m", "other"}
    plain = _load(gguf, root, is_cached=False)
    for a, b in zip(_packed(fresh), _packed(plain), strict=True):
        assert torch.equal(a, b)


def test_a_damaged_entry_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gguf = write_tiny_llama(tmp_path / "m.gguf", MIX, T.Q4_K)
    root = tmp_path / "cache"
    # Cloned: the model maps the entry's file, which the test is about to damage in place.
    reference = [t.clone() for t in _packed(_load(gguf, root))]
    (entry,) = _entries(root)
    data = entry / "weights.bin"
    data.write_bytes(data.read_bytes()[:-64])  # a short write
    assert not PackedCache(gguf, root).is_hit
    assert "damaged packed-weight cache" in caplog.text
    for a, b in zip(reference, _packed(_load(gguf, root)), strict=True):
        assert torch.equal(a, b)
    assert PackedCache(gguf, root).is_hit  # written afresh


def test_unwritable_cache_and_cache_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gguf = write_tiny_llama(tmp_path / "m.gguf", {}, T.Q8_0)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would go")
    model = _load(gguf, blocked)
    assert "cache not written" in caplog.text
    assert model.weight_format.startswith("gguf Q8_0 (packed int8")
    root = tmp_path / "off"
    _load(gguf, root, is_cached=False)
    assert not root.exists()
    # Nothing to pack (an F16 file): no entry, and no complaint at the next load.
    dense = write_tiny_llama(tmp_path / "f16.gguf", {}, T.F16)
    caplog.clear()
    _load(dense, root)
    _load(dense, root)
    assert not root.exists() and "cache" not in caplog.text


def test_a_full_disk_costs_only_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gguf = write_tiny_llama(tmp_path / "m.gguf", MIX, T.Q4_K)
    root = tmp_path / "cache"
    reference = _packed(_load(gguf, root, is_cached=False))
    monkeypatch.setattr(
        packed_cache.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 40, 0, 1 << 20)
    )
    for a, b in zip(reference, _packed(_load(gguf, root)), strict=True):
        assert torch.equal(a, b)
    assert "cache not written" in caplog.text and "GiB needed" in caplog.text
    assert not list((root / "packed").iterdir())


def test_released_pages_read_back_from_the_page_cache(tmp_path: Path) -> None:
    """Where weights are tiled at load, the cache's touched pages are unmapped afterwards
    (``release_pages``); the tensors still mapped from it (an embedding table) read the same."""
    gguf = write_tiny_llama(tmp_path / "mix.gguf", MIX, T.Q4_K, is_tied=False)
    root = tmp_path / "cache"
    _load(gguf, root)
    cache = PackedCache(gguf, root)
    name = next(iter(json.loads((_entries(root)[0] / "index.json").read_text())["entries"]))
    weight = cache.get(name)
    assert weight is not None
    before = [t.clone() for t in weight.tensors() if t is not None]
    cache.release_pages()
    after = [t for t in weight.tensors() if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
