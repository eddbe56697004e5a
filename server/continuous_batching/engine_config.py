"""The continuous-batching engine's configuration: one object, validated at start-up.

The three sections follow the seed's ``cb_server_config.json`` (``model_loading_config``,
``batcher_config``, ``cache_config``); unknown keys are refused so typos stop start-up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from utils.config import ConfigSection

TorchDtypeName = Literal["float32", "bfloat16", "float16"]

#: Architecture families the engine runs -> the checkpoint ``model_type`` values of each (the
#: checkpoints our llama code runs unchanged; see ``model.architecture``).
MODEL_TYPE_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"),
    "gemma": ("gemma2", "gemma3_text"),
}


#: The quantization tag GGUF file names end with (``.Q4_1``, ``-q4_k_m``, ``.F16``, ``.BF16``).
_GGUF_QUANT_TAG = re.compile(r"[.-](?:I?Q\d[\w]*|B?F16|F32)$", re.IGNORECASE)


def gguf_path(model_path: str | Path, gguf_file: str | None = None) -> Path | None:
    """The GGUF file to load, or None for a Hugging Face folder.

    ``gguf_file`` is a file name inside the ``model_path`` folder (transformers' convention) or
    a path of its own; otherwise ``model_path`` itself is the file when it ends in ``.gguf``.
    """
    if gguf_file:
        path = Path(gguf_file)
        if not path.is_absolute() and Path(model_path).is_dir():
            path = Path(model_path) / gguf_file
        return path
    if str(model_path).lower().endswith(".gguf"):
        return Path(model_path)
    return None


#: ``gguf_activations: auto`` quantises matmul inputs to int8 from this many weights up.
AUTO_INT8_MIN_PARAMETERS = 1_000_000_000


class ModelLoadingConfig(ConfigSection):
    """Where the weights are and how to run them."""

    model_type: Literal["auto", "llama", "gemma"] = Field(
        default="auto",
        description="architecture family the checkpoint must belong to: auto (any the engine "
        "runs: its config.json architecture decides), llama (model_type llama, mistral, qwen2, "
        "qwen3, phi3, mixtral or qwen3_moe) or gemma (gemma2, gemma3_text); checked at load",
    )
    model_name_or_path: str
    tokenizer_name_or_path: str | None = None
    torch_dtype: TorchDtypeName = "bfloat16"
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)
    model_max_length: int | None = Field(default=None, ge=2)
    use_fast_tokenizer: bool = Field(
        default=True, description="load the tokenizer with use_fast (its Rust implementation)"
    )
    trust_remote_code: bool = Field(
        default=False,
        description="lets the tokenizer run code shipped with the checkpoint (a custom tokenizer "
        "class); the model itself always runs the engine's own llama code, never checkpoint code",
    )
    quantize_method: Literal["gptq", "int8", "int4"] | None = Field(
        default=None,
        description="gptq: an int4 GPTQ folder (also detected from its config); int8 / int4: "
        "quantise a dense checkpoint at load (llama.cpp's Q8_0 / Q4_1 for the layers' matmuls, "
        "Q8_0 for the lm_head), kept packed for the CPU kernels: about half / a quarter of the "
        "matmul bytes; CPU only",
    )
    gptq_model_base_name: str | None = Field(
        default=None, description="GPTQ weights file without .safetensors (default: all)"
    )
    gptq_config_base_name: str | None = Field(
        default=None, description="GPTQ settings file without .json (quantize_config)"
    )
    gptq_dequantize_at_load: bool = Field(
        default=False, description="dense weights at load: faster, but no int4 memory saving"
    )
    gptq_cpu_kernel: Literal["auto", "torch", "packed"] = Field(
        default="auto",
        description="GPTQ int4 matmuls on a CPU: torch's int4 kernel, or packed: repacked exactly "
        "into the GGUF kernels' layout (float or int8 activations, as gguf_activations says); "
        "auto: torch's where it applies (bf16/fp16, groups of 32-256 that divide the input), "
        "else packed (where torch would dequantise the layer on every call)",
    )
    gguf_dequantize_at_load: bool = Field(
        default=False,
        description="GGUF: dequantise every tensor to torch_dtype at load (the plain path) "
        "instead of keeping Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K matmul weights packed on a CPU",
    )
    gguf_activations: Literal["auto", "float", "int8"] = Field(
        default="auto",
        description="GGUF weights kept packed (also int8/int4 at load and packed GPTQ): float "
        "keeps each matmul's input in float32 (the plain path's numbers); int8 quantises it "
        "per weight group (K-quants, GPTQ g128: per super-block) as llama.cpp does (integer "
        "dot products, 1.3-2x the float kernel's speed on a 1B Q4_K_M or Q8_0 file; each "
        "value off by up to 1/254 of its block's largest, which moves a model as small as "
        "SmolLM2-135M off its answer, in llama.cpp too); auto: int8 for models of at least "
        "1B weights, float below",
    )
    cache_packed_weights: bool = Field(
        default=True,
        description="keep the packed form of a quantised GGUF on disk after its first load "
        "(under load_cache_dir; about the file's size): later starts memory-map it instead of "
        "repacking. One entry per file, replaced when the file changes",
    )
    load_cache_dir: str | None = Field(
        default=None,
        description="folder of the load caches (packed weights, tokenizers converted from "
        "GGUF files); default $LLM_SUITE_CACHE_DIR, else $XDG_CACHE_HOME/llm_suite "
        "(~/.cache/llm_suite)",
    )
    gguf_file: str | None = Field(
        default=None,
        description="GGUF file (in model_name_or_path, or a path); a model_name_or_path "
        "ending in .gguf is loaded as GGUF too",
    )
    served_model_name: str | None = None
    cpu_kernels: bool = Field(
        default=True,
        description="on a CPU, run the fused C++ decoder kernels (built once per machine; the "
        "torch ops run, with a warning, when they cannot be built; LLM_SUITE_CPU_KERNELS=0 also "
        "turns them off)",
    )
    cpu_isa: Literal["auto", "generic", "avx2", "avx512", "avx512_bf16"] = Field(
        default="auto",
        description="on a CPU, the ISA level of the fused kernels: auto picks the best this CPU "
        "has (or LLM_SUITE_CPU_ISA, when set); a lower one forces that path (testing, "
        "comparison); one above the CPU's is capped to it, with a warning; generic runs torch ops",
    )
    enforce_eager: bool = Field(
        default=False,
        description="never capture CUDA graphs (decode steps replay graphs only on cuda with "
        "triton installed; a CPU always runs eagerly)",
    )

    @field_validator("model_type", mode="before")
    @classmethod
    def _check_model_type(cls, value: Any) -> Any:
        if value != "auto" and value not in MODEL_TYPE_FAMILIES:
            families = ", ".join(
                f"{name!r} ({', '.join(types)} checkpoints)"
                for name, types in MODEL_TYPE_FAMILIES.items()
            )
            raise ValueError(
                f"model type {value!r} is not supported: the continuous-batching engine runs "
                f"these families only: {families}"
            )
        return value

    def is_int8_activations(self, num_parameters: int) -> bool:
        """Whether packed matmuls quantise their inputs to int8 for a model of
        ``num_parameters`` weights (``gguf_activations``)."""
        if self.gguf_activations == "auto":
            return num_parameters >= AUTO_INT8_MIN_PARAMETERS
        return self.gguf_activations == "int8"

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file the weights (and maybe the tokenizer) come from, else None."""
        return gguf_path(self.model_name_or_path, self.gguf_file)

    @property
    def served_model_id(self) -> str:
        """The model id the server answers to: ``served_model_name``, else the folder's name,
        or a GGUF file's name without ``.gguf`` and its quantization tag
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model_name_or_path)
        if path.suffix.lower() != ".gguf":
            return path.name
        return _GGUF_QUANT_TAG.sub("", path.stem) or path.stem

    def check_checkpoint_model_type(self, checkpoint_model_type: str | None) -> None:
        """Refuse a checkpoint outside the configured family (``ValueError`` naming the key);
        "auto" takes a checkpoint of any family."""
        if self.model_type == "auto":
            family = tuple(t for types in MODEL_TYPE_FAMILIES.values() for t in types)
        else:
            family = MODEL_TYPE_FAMILIES[self.model_type]
        if checkpoint_model_type not in family:
            raise ValueError(
                f"model_loading_config.model_type is {self.model_type!r}, which runs "
                f"checkpoints of model_type {', '.join(family)}, but {self.model_name_or_path} "
                f"is model_type {checkpoint_model_type!r}"
            )


class BatcherConfig(ConfigSection):
    """Per-step limits of the scheduler."""

    batch_max_tokens: int = Field(
        default=1024, ge=16, description="tokens processed per step (prefill chunks + decodes)"
    )
    batch_max_beams: int = Field(
        default=64, ge=1, description="sequences (beams, samples) running at once"
    )
    max_num_waiting: int = Field(
        default=1024, ge=1, description="requests queued beyond this are refused (503)"
    )
    overlap_detokenization: bool | None = Field(
        default=None,
        description="detokenise a step's tokens and check stop strings while the next step's "
        "forward runs (a sequence a stop string ends then runs one step for nothing); null: on "
        "with cuda, off on a CPU, where the forward itself runs on the host",
    )


class CacheConfig(ConfigSection):
    """The paged KV cache: device pool, CPU swap pool, block size."""

    num_blocks: int | None = Field(
        default=None,
        ge=1,
        description="device blocks; when null, derived from gpu_memory_utilization on cuda and "
        "from memory_budget_gb on a CPU",
    )
    memory_budget_gb: float = Field(
        default=2.0,
        gt=0,
        description="on a CPU device, memory for the KV cache when num_blocks is null (on cuda "
        "gpu_memory_utilization sizes it); capped, with a warning, to what the machine (or the "
        "process's cgroup) has available after loading, less 2 GiB",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="on cuda, only when num_blocks is null: the share of the GPU's memory the "
        "server may fill; the KV pool gets what it leaves after the weights and the peak of a "
        "warm-up step of batch_max_tokens tokens (other processes on the GPU count as used)",
    )
    num_blocks_cpu: int = Field(default=256, ge=0, description="CPU blocks for swapping")
    block_size: int = Field(default=16, ge=1, le=1024)
    watermark: float = Field(
        default=0.01, ge=0.0, lt=1.0, description="share of device blocks kept free at admission"
    )
    enable_prefix_caching: bool = True


class EngineConfig(ConfigSection):
    """Everything the engine needs; the CB server config file adds serving keys around it."""

    model_loading_config: ModelLoadingConfig
    batcher_config: BatcherConfig = Field(default_factory=BatcherConfig)
    cache_config: CacheConfig = Field(default_factory=CacheConfig)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        loading = self.model_loading_config
        method = loading.quantize_method
        if method == "gptq" and loading.gguf_path is not None:
            raise ValueError(
                "model_loading_config.quantize_method: gptq needs a GPTQ folder, not a GGUF file"
            )
        if method in ("int8", "int4"):
            if loading.gguf_path is not None:
                raise ValueError(
                    f"model_loading_config.quantize_method: {method} quantises a dense "
                    "checkpoint at load; a GGUF file is quantised already (its own types run)"
                )
            if not loading.device.startswith("cpu"):
                raise ValueError(
                    f"model_loading_config.quantize_method: {method} runs on the CPU kernels; "
                    f"on {loading.device} serve a GPTQ checkpoint (quantize_method: gptq)"
                )
        return self
