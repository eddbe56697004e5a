"""GPTQ int4 loading against an independent reference.

The test quantises the default model's seven linear layers per block (round-to-nearest,
asymmetric, per group: no calibration needed to test the *format*) and writes them the way
AutoGPTQ / GPTQModel lay them out, with writer code of its own (numpy packing, the v1
``zero - 1`` offset). The reference is transformers running the dequantised float32 weights,
computed here from the unpacked codes (never through the engine's reader).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from harness.gptq_writer import pack_layer, rtn_quantize, write_checkpoint
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig, ModelLoadingConfig
from server.continuous_batching.model import (
    LlamaForCausalLM,
    build_attention_metadata,
    kv_cache_shape,
)
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.quantization import (
    ConcatLinear,
    GPTQConfig,
    QuantLinear,
    fuse,
    quant_linear,
)

CPU = torch.device("cpu")


#: These tests pin down the QuantLinear path (torch's int4 kernel and its portable fallback);
#: the packed one is tests/engine/test_gptq_packed.py.
TORCH_INT4 = {"gptq_cpu_kernel": "torch"}


def loading(path: Path, **options: object) -> ModelLoadingConfig:
    """The model_loading_config of a checkpoint on the CPU (float32 unless told)."""
    return ModelLoadingConfig.model_validate(
        {"model_name_or_path": str(path), "torch_dtype": "float32", **TORCH_INT4, **options}
    )


BLOCK = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small dragon"]


@pytest.fixture(scope="module")
def source(default_model_path: Path) -> dict[str, torch.Tensor]:
    """The default model's float32 tensors."""
    return load_file(str(default_model_path / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_ref(default_model_path: Path) -> HFLlama:
    """One transformers model; each case loads its dequantised weights into it."""
    return HFLlama(LlamaConfig.from_pretrained(default_model_path)).eval()


@pytest.fixture(scope="module")
def prompt_ids(default_model_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    return [tokenizer(p).input_ids for p in PROMPTS]


def our_last_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """One forward prefilling every prompt; the logits of each prompt's last token."""
    lens = [len(p) for p in prompts]
    tables, nxt = [], 1
    for n in lens:
        count = -(-n // BLOCK)
        tables.append(list(range(nxt, nxt + count)))
        nxt += count
    meta = build_attention_metadata(lens, lens, tables, BLOCK, CPU)
    shape = kv_cache_shape(model.config, nxt, BLOCK)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in model.layers
    ]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    hidden = model(ids, positions, caches, meta)
    return model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])


def reference_logits(
    hf: HFLlama, reference: dict[str, torch.Tensor], prompts: list[list[int]]
) -> torch.Tensor:
    """transformers' last-token logits with the dequantised weights loaded."""
    result = hf.load_state_dict(reference, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """float32 tolerance scaled by the logit magnitude (as in test_cb_model)."""
    atol = rel * float(expected.abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=0)


def check_model(
    ours: LlamaForCausalLM,
    hf: HFLlama,
    reference: dict[str, torch.Tensor],
    prompts: list[list[int]],
) -> torch.Tensor:
    """Exact dequantised weights in layer 0, then logits against transformers."""
    layer = ours.layers[0]
    assert isinstance(layer.qkv, QuantLinear) and layer.qkv_weight is None
    names = ("q_proj", "k_proj", "v_proj")
    qkv = torch.cat([reference[f"model.layers.0.self_attn.{n}.weight"] for n in names]).t()
    perm = layer.qkv.perm
    assert torch.equal(layer.qkv.weight(), qkv if perm is None else qkv[perm])
    logits = our_last_logits(ours, prompts)
    assert_logits_close(logits, reference_logits(hf, reference, prompts))
    return logits


@pytest.fixture(scope="module")
def v1_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path, source
) -> tuple[Path, dict[str, torch.Tensor]]:
    """AutoGPTQ v1, group 64, no act-order, settings in both quantize_config and config."""
    folder = tmp_path_factory.mktemp("gptq_v1")
    return folder, write_checkpoint(
        folder, default_model_path, source, fmt="gptq", group_size=64, desc_act=False
    )


def test_v1_int4_matches_dequantised_transformers(v1_checkpoint, hf_ref, prompt_ids) -> None:
    folder, reference = v1_checkpoint
    ours, _ = load_model(loading(folder, quantize_method="gptq"))
    assert ours.layers[0].qkv.perm is None and ours.layers[0].qkv.row_groups is None
    int4 = check_model(ours, hf_ref, reference, prompt_ids)
    # The dequantise-at-load option runs the same weights through the dense path.
    dense, _ = load_model(loading(folder, gptq_dequantize_at_load=True))
    assert dense.layers[0].qkv_weight is not None and not dense.layers[0].replaced
    assert_logits_close(our_last_logits(dense, prompt_ids), int4, rel=1e-5)


VARIANTS = {
    # AutoGPTQ's own file name, act-order with a shuffled g_idx, quantize_config.json only.
    "v1_act_order": {
        "fmt": "gptq",
        "group_size": 32,
        "desc_act": True,
        "weights_name": "gptq_model-4bit-32g.safetensors",
        "config_in": ("quantize_config",),
    },
    # GPTQModel v2 (no zero offset), config.json only; 576 inputs / 128 leave a short group.
    "v2_short_group": {
        "fmt": "gptq_v2",
        "group_size": 128,
        "desc_act": False,
        "config_in": ("config",),
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_format_variants_match_dequantised_transformers(
    variant: str, tmp_path: Path, default_model_path: Path, source, hf_ref, prompt_ids
) -> None:
    spec = VARIANTS[variant]
    reference = write_checkpoint(tmp_path, default_model_path, source, **spec)
    base = "gptq_model-4bit-32g" if spec["desc_act"] else None
    ours, _ = load_model(loading(tmp_path, gptq_model_base_name=base))
    qkv = ours.layers[0].qkv
    assert (qkv.perm is not None) == spec["desc_act"]
    assert (qkv.row_groups is not None) == (spec["group_size"] == 128)
    check_model(ours, hf_ref, reference, prompt_ids)


def test_engine_greedy_matches_transformers(v1_checkpoint, hf_ref) -> None:
    folder, reference = v1_checkpoint
    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(folder),
                "torch_dtype": "float32",
                "quantize_method": "gptq",
                **TORCH_INT4,
            },
            "cache_config": {"num_blocks": 64, "num_blocks_cpu": 0},
        }
    )
    engine = LLMEngine(config)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    (deltas,) = engine.generate([ids], [GenerationConfig(max_new_tokens=8)])
    hf_ref.load_state_dict(reference, strict=False)
    with torch.no_grad():
        expected = hf_ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected_tokens = expected[0, len(ids) :].tolist()
    if 2 in expected_tokens:  # generate pads after EOS; the engine stops at it
        expected_tokens = expected_tokens[: expected_tokens.index(2) + 1]
    assert [t for d in deltas for t in d.token_ids] == expected_tokens


def test_quant_linear_units() -> None:
    """v1 zero 0 (stored as 15 within its nibble), biases, fusion with and without equal g_idx."""
    gen = torch.Generator().manual_seed(1)
    config = GPTQConfig(bits=4, group_size=16, desc_act=True, sym=False, checkpoint_format="gptq")
    layers, dense = [], []
    for i in range(3):
        weight = torch.randn(24, 64, generator=gen)
        weight[:5] = weight[:5].abs()  # all-positive groups: zero point 0
        order = torch.arange(64) if i < 2 else torch.randperm(64, generator=gen)
        q = rtn_quantize(weight, 16, order)
        assert i or bool((q.zeros == 0).any())
        tensors = {**pack_layer(q, "gptq"), "bias": torch.randn(24, generator=gen).half()}
        layers.append(QuantLinear.from_gptq(tensors, config, torch.float32, CPU))
        dense.append((q.dequantize(), tensors["bias"].float()))
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 24, generator=gen)
    for layer, (w, b) in zip(layers, dense, strict=True):
        torch.testing.assert_close(layer(x), x @ w.t() + b)
        torch.testing.assert_close(layer.add_to(residual, x), residual + x @ w.t() + b)
    expected = torch.cat([x @ w.t() + b for w, b in dense], dim=1)
    assert isinstance(fuse(layers[:2]), QuantLinear)
    torch.testing.assert_close(fuse(layers[:2])(x), expected[:, :48])
    mixed = fuse(layers)  # the third layer has another act-order: no single matmul
    assert isinstance(mixed, ConcatLinear)
    torch.testing.assert_close(mixed(x), expected)


def half_ulp(t: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 step at each magnitude: the most one rounding to bfloat16 moves a value."""
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(2**-60))) - 8)


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element of ``got`` within its own ``bound`` of ``expected``."""
    excess = (got - expected).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"element {worst}: got {got.flatten()[worst]:.4f}, expected {expected.flatten()[worst]:.4f}"
        f" within {bound.flatten()[worst]:.4f}"
    )


def test_cpu_int4_kernel_matches_portable_path(monkeypatch) -> None:
    """bfloat16 layers on torch's CPU int4 kernel (act-order inputs, bias, q|k|v-style concat)
    agree with the portable dequantise-then-matmul path and with the float32 reference."""
    gen = torch.Generator().manual_seed(2)
    config = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq")
    order = torch.randperm(128, generator=gen)
    quantized = [rtn_quantize(torch.randn(n, 128, generator=gen), 32, order) for n in (64, 32)]
    tensors = [
        {**pack_layer(q, "gptq_v2"), "bias": torch.randn(q.codes.shape[1], generator=gen).half()}
        for q in quantized
    ]
    config = GPTQConfig(**{**config.__dict__, "checkpoint_format": "gptq_v2"})

    def build() -> QuantLinear:
        return fuse([QuantLinear.from_gptq(t, config, torch.bfloat16, CPU) for t in tensors])

    kernel = build()
    monkeypatch.setattr(quant_linear, "CPU_KERNEL_ENABLED", False)
    portable = build()
    assert kernel.kernel is not None and portable.kernel is None
    assert kernel.nbytes < portable.nbytes * 1.1  # still 4 bits a weight
    x, residual = torch.randn(7, 128, generator=gen), torch.randn(7, 96, generator=gen)
    w = torch.cat([q.dequantize() for q in quantized]).t()
    b = torch.cat([t["bias"].float() for t in tensors])
    xw = x @ w
    # What bfloat16 may cost, element by element: rounding inputs and weights (half a step each,
    # summed over the dot product), then rounding x @ w and each later add. A fixed atol is flaky
    # here: x @ w reaches ~40 (steps of 0.25) while a bias can bring the sum near 0.
    products = 2**-8 * (x.abs() @ w.abs())
    for layer in (kernel, portable):
        bound = products + half_ulp(xw) + half_ulp(xw + b)
        assert_within(layer(x.bfloat16()).float(), xw + b, bound)
        got = layer.add_to(residual.bfloat16(), x.bfloat16()).float()
        sums = half_ulp(residual) + half_ulp(xw + residual) + half_ulp(xw + residual + b)
        assert_within(got, residual + xw + b, bound + sums)
    torch.testing.assert_close(
        kernel.weight().float(), portable.weight().float(), atol=0.02, rtol=0.01
    )


def test_bfloat16_int4_model_tracks_reference(v1_checkpoint, hf_ref, prompt_ids) -> None:
    folder, reference = v1_checkpoint
    ours, _ = load_model(loading(folder, torch_dtype="bfloat16"))
    assert ours.layers[0].qkv.kernel is not None  # the CPU int4 kernel path
    ours_logits = our_last_logits(ours, prompt_ids).float()
    expected = reference_logits(hf_ref, reference, prompt_ids)
    assert_logits_close(ours_logits, expected, rel=0.05)
    assert ours_logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
