"""Load a llama-family checkpoint into the continuous-batching model.

Loading is split in two so checkpoint formats plug in:

* a *source* yields ``(hf_name, tensor)`` pairs in Hugging Face naming: ``iter_safetensors``
  (a Hugging Face folder), ``weights_gguf.iter_gguf`` (a llama.cpp GGUF file, dequantised),
  or the dense part of a GPTQ folder;
* ``assign_weights`` copies those pairs into the model's (partly fused) parameters, casting
  to the model dtype, and checks that every parameter was filled exactly once.

``load_model`` takes the ``model_loading_config`` and picks the source: a ``.gguf`` file (or
``gguf_file``), a GPTQ or AWQ folder (its
``quantize_config.json`` or ``quantization_config`` says so; ``checkpoint_formats`` decides,
AWQ layers are converted exactly to GPTQ's), else plain safetensors. GPTQ
layers become int4 ``QuantLinear``s installed in place of the dense matmuls, or, with
``gptq_dequantize_at_load``, dense weights like any other checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import torch
from safetensors import safe_open

from ..engine_config import ModelLoadingConfig
from ..load_cache import cache_root
from ..quantization.checkpoint_formats import QuantCheckpoint, read_quant_checkpoint
from ..quantization.gptq import GPTQConfig, dequantize_gptq, gptq_files, split_gptq_checkpoint
from ..quantization.gptq_packed import GPTQPacking
from ..quantization.packed_cache import PackedCache
from ..quantization.packed_linear import kernels_can_pack
from ..quantization.quant_linear import QuantLinear, fuse
from . import cpu_isa
from .architecture import ModelArchConfig
from .families import read_hf_config
from .gemma import GemmaForCausalLM
from .gguf_file import GGUFFile
from .llama import LlamaForCausalLM
from .model_classes import model_class_for
from .moe_weights import canonical_expert_tensors
from .weights_at_load import AT_LOAD_TYPES, quantize_at_load
from .weights_gguf import iter_gguf, open_gguf, read_gguf_config
from .weights_gguf_packed import install_packed_linears

logger = logging.getLogger(__name__)

#: ``model_loading_config.torch_dtype`` -> the dtype the model computes in.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Tensors some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)

#: Our fused matmuls -> the Hugging Face projections they hold, in output order.
_FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


class WeightLoadError(RuntimeError):
    """The checkpoint's tensors do not match the model built from its config."""


def read_arch_config(model_path: str | Path) -> ModelArchConfig:
    """Parse ``config.json`` of a Hugging Face model folder."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {model_path}")
    return read_hf_config(json.loads(config_file.read_text()))


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards listed by the index file if present,
    else every ``*.safetensors`` in the folder."""
    folder = Path(model_path)
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {model_path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors shards listed but missing: {missing}")
    return files


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor of a (possibly sharded) safetensors folder.
    Tensors are read lazily one at a time, so peak memory stays near one tensor above the
    model itself."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                yield name, f.get_tensor(name)


def assign_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model's parameters (fused ones by row range).

    Raises WeightLoadError naming unexpected, duplicate, mis-shaped or missing tensors.
    A stored ``lm_head.weight`` is skipped when the embeddings are tied (some tied
    checkpoints keep a copy).
    """
    targets = model.hf_weight_targets()
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        # Experts' tensors of any layout (Mixtral's, stacked) under the names the model uses.
        for name, tensor in canonical_expert_tensors(tensors):
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if name in seen:
                raise WeightLoadError(f"tensor {name!r} appears twice in the checkpoint")
            param, start, end = target
            expected = (end - start, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            param[start:end].copy_(tensor)
            seen.add(name)
    missing = sorted(set(targets) - seen)
    if unexpected or missing:
        raise WeightLoadError(
            f"checkpoint does not match the model: missing {_preview(missing)}, "
            f"unexpected {_preview(unexpected)}"
        )


def _preview(names: list[str], limit: int = 8) -> str:
    """Short list of names for an error message."""
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}" if names else "none"


def load_model(config: ModelLoadingConfig) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build the model and fill it from a Hugging Face folder, a GPTQ folder or a GGUF file.

    ``quantize_method="gptq"`` insists on a GPTQ folder; a folder whose config says GPTQ is
    loaded as GPTQ either way (the format describes itself, as in transformers). Raises
    UnsupportedModelError (not a llama), ValueError (a checkpoint outside ``model_type``'s
    family), WeightLoadError or GPTQFormatError.
    """
    dtype = TORCH_DTYPES[config.torch_dtype]
    device = torch.device(config.device)
    cpu_path = cpu_isa.resolve(config.cpu_isa)
    model_path = config.model_name_or_path
    gguf = config.gguf_path
    if gguf is not None:
        reader = open_gguf(gguf)
        arch = read_gguf_config(reader)
        config.check_checkpoint_model_type(arch.model_type)
        model = model_class_for(arch)(
            arch, dtype=dtype, device=device, use_cpu_kernels=config.cpu_kernels, cpu_path=cpu_path
        )
        skip = _install_gguf_packed(model, reader, arch, config)
        assign_weights(model, iter_gguf(reader, arch, skip))
        if isinstance(model, GemmaForCausalLM):
            # llama.cpp's converter wrote Gemma's norms as 1 + w: finalize must not add 1 again.
            model.is_norm_folded = True
    else:
        arch = read_arch_config(model_path)
        config.check_checkpoint_model_type(arch.model_type)
        model = model_class_for(arch)(
            arch, dtype=dtype, device=device, use_cpu_kernels=config.cpu_kernels, cpu_path=cpu_path
        )
        quant = read_quant_checkpoint(model_path, config.gptq_config_base_name)
        if config.quantize_method == "gptq" and quant is None:
            raise WeightLoadError(
                f"quantize_method is gptq but {model_path} has no quantize_config.json "
                "and no GPTQ (or AWQ) quantization_config in config.json"
            )
        dtype_name = str(dtype).removeprefix("torch.")
        if quant is None:
            assign_weights(model, iter_safetensors(model_path))
            model.weight_format = f"{dtype_name} dense"
            if config.quantize_method in AT_LOAD_TYPES:
                _quantize_at_load(model, config)
        elif config.quantize_method in AT_LOAD_TYPES:
            raise WeightLoadError(
                f"quantize_method is {config.quantize_method} but {model_path} is a "
                f"{quant.format.name.upper()} checkpoint (quantised already): leave "
                "quantize_method out, or set gptq"
            )
        else:
            files = gptq_files(model_path, config.gptq_model_base_name)
            packing = _gptq_packing(model, config)
            num_packed, num_torch = _load_gptq(
                model, files, quant, config.gptq_dequantize_at_load, packing
            )
            kept = "dequantised at load" if config.gptq_dequantize_at_load else "int4 QuantLinear"
            if packing is not None and num_packed:
                activations = ", int8 activations" if packing.is_int8_activations else ""
                kept = f"int4 packed ({model.cpu_path.level}{activations})"
                if num_torch:
                    kept = f"int4 QuantLinear ({num_torch} matmuls) and {kept} ({num_packed})"
            model.weight_format = f"{quant.format.name} {kept}, {dtype_name} dense elsewhere"
    model.finalize()
    model.eval()
    return model, arch


def _install_gguf_packed(
    model: LlamaForCausalLM, reader: GGUFFile, arch: ModelArchConfig, config: ModelLoadingConfig
) -> set[str]:
    """Keep the GGUF's quantised matmul weights packed where the CPU kernels run (see
    ``weights_gguf_packed``; int8 activations as ``config.gguf_activations`` says); returns
    the GGUF tensor names installed that way. Otherwise (``gguf_dequantize_at_load``, not a
    CPU, no kernels) nothing: every tensor is dequantised."""
    kernels = model.decoder_ops.module
    dtype_name = str(model.dtype).removeprefix("torch.")
    is_cpu = model.device.type == "cpu"
    if config.gguf_dequantize_at_load or not is_cpu or not kernels_can_pack(kernels):
        model.weight_format = f"gguf dequantised to {dtype_name} at load"
        return set()
    is_int8 = config.is_int8_activations(arch.num_parameters)
    cache = None
    if config.cache_packed_weights:
        cache = PackedCache(reader.path, cache_root(config.load_cache_dir))
    start = time.perf_counter()
    load = install_packed_linears(model, reader, arch, kernels, is_int8, cache)
    if cache is not None and load.is_lane_tiled:
        cache.release_pages()
    model.weight_format = load.describe(model.cpu_path.level)
    logger.info(
        "GGUF weights kept quantised: %s; %d tensors, %.1f MiB packed, %s in %.1f s",
        model.weight_format,
        sum(load.num_tensors.values()),
        load.num_bytes / 2**20,
        load.origin,
        time.perf_counter() - start,
    )
    return load.consumed


def _quantize_at_load(model: LlamaForCausalLM, config: ModelLoadingConfig) -> None:
    """``quantize_method`` int8 / int4 on a dense checkpoint (``weights_at_load``)."""
    start = time.perf_counter()
    method = config.quantize_method
    assert method is not None  # the caller checked
    is_int8 = config.is_int8_activations(model.config.num_parameters)
    result = quantize_at_load(model, method, is_int8)
    dtype_name = str(model.dtype).removeprefix("torch.")
    model.weight_format = result.describe(model.cpu_path.level, dtype_name)
    logger.info(
        "quantised at load in %.1f s: %s; %d tensors, %.1f MiB (%.1f MiB at %s)",
        time.perf_counter() - start,
        model.weight_format,
        result.num_tensors,
        (result.num_bytes if result.is_packed else result.num_dense_bytes) / 2**20,
        result.num_dense_bytes / 2**20,
        dtype_name,
    )


def _gptq_packing(model: LlamaForCausalLM, config: ModelLoadingConfig) -> GPTQPacking | None:
    """The packed kernels for GPTQ layers when ``gptq_cpu_kernel`` asks and they run here."""
    kernels = model.decoder_ops.module
    if config.gptq_cpu_kernel == "torch" or model.device.type != "cpu":
        return None
    if not kernels_can_pack(kernels):
        if config.gptq_cpu_kernel == "packed":
            logger.warning("gptq_cpu_kernel packed: no packed kernels on this path; torch runs")
        return None
    is_auto = config.gptq_cpu_kernel == "auto"
    is_int8 = config.is_int8_activations(model.config.num_parameters)
    return GPTQPacking(kernels, is_int8, is_auto, model.dtype)


def _load_gptq(
    model: LlamaForCausalLM,
    files: list[Path],
    quant: QuantCheckpoint,
    dequantize_at_load: bool,
    packing: GPTQPacking | None = None,
) -> tuple[int, int]:
    """Fill the model from a GPTQ checkpoint: a layer's four matmuls as int4 ``QuantLinear``s
    (or packed linears with ``packing``; unless ``dequantize_at_load``), any other quantised
    tensor (e.g. a quantised lm_head) dequantised, and everything through ``assign_weights``.
    Returns how many fused matmuls went packed and how many to ``QuantLinear``."""
    quantized, dense_names = split_gptq_checkpoint(files)
    quantized = {prefix: quant.format.convert(parts) for prefix, parts in quantized.items()}
    gptq = quant.config
    num_packed = num_torch = 0
    logger.info("%s checkpoint: %d quantised layers, %s", quant.format.name, len(quantized), gptq)
    for i, layer in enumerate([] if dequantize_at_load else model.layers):
        linears = {}
        for name, projections in _FUSED_PROJECTIONS.items():
            prefixes = [f"model.layers.{i}.{p}" for p in projections]
            found = [p for p in prefixes if p in quantized]
            if found and len(found) != len(prefixes):
                raise WeightLoadError(f"only some of the fused layers {prefixes} are quantised")
            parts = [quantized[p] for p in prefixes] if found else []
            if parts and packing is not None and packing.takes(parts, gptq):
                linear = packing.linear(parts, gptq)
                if linear is not None:
                    for p in prefixes:
                        del quantized[p]
                    linears[name] = linear
                    num_packed += 1
                    continue
            if found:
                num_torch += 1
                int4_parts = [
                    QuantLinear.from_gptq(quantized.pop(p), gptq, model.dtype, model.device)
                    for p in prefixes
                ]
                linears[name] = fuse(int4_parts)
        layer.replace_linears(linears)
    # The rest gets dense weights: the dense matmul path (with CPU prepacking) is the fastest,
    # at the memory of the compute dtype.
    assign_weights(model, chain(_dequantized(quantized, gptq), _read_tensors(dense_names)))
    return num_packed, num_torch


def _dequantized(
    quantized: dict[str, dict[str, torch.Tensor]], gptq: GPTQConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named dense weights (and biases) of quantised layers, one layer at a time."""
    for prefix, parts in quantized.items():
        yield f"{prefix}.weight", dequantize_gptq(parts, gptq)
        if "bias" in parts:
            yield f"{prefix}.bias", parts["bias"]


def _read_tensors(names: list[tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the named tensors lazily, one file open at a time."""
    for file in dict.fromkeys(f for f, _ in names):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in (n for g, n in names if g == file):
                yield name, f.get_tensor(name)
