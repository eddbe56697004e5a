"""A GGUF file as a Hugging Face safetensors folder, with transformers.

transformers can read GGUF (it dequantises to float32 with the ``gguf`` package) but refuses
``save_pretrained`` on such a model, so the weights are copied into a freshly built
``LlamaForCausalLM`` and that is saved. ``tools.prepare_model`` runs this for the default model,
under its lock and into a temporary folder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

#: Times one stage of the conversion and logs it (``tools.prepare_model._step``).
Step = Callable[[str], AbstractContextManager[None]]


class ConversionError(RuntimeError):
    """The GGUF file does not make a complete model folder (weights, tokenizer)."""


def _load_from_gguf(gguf_path: Path, step: Step) -> tuple[Any, Any]:
    """Load the tokenizer and a float32 model from the GGUF file with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with step(f"loading tokenizer from {gguf_path}"):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with step("loading and dequantising the GGUF model to float32"):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model


def _rebuild_serializable(gguf_model: Any) -> Any:
    """Copy the weights of a GGUF-loaded model into a model that ``save_pretrained`` accepts.

    transformers marks GGUF-loaded models as quantised ("not serializable"); a fresh model built
    from the same config without ``quantization_config`` carries no such mark.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = gguf_model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    if hasattr(clean_config, "quantization_config"):
        delattr(clean_config, "quantization_config")
    clean_config.dtype = torch.float32

    # Building on the meta device skips random initialisation of 135M parameters that the
    # state dict overwrites anyway; assign=True then adopts the loaded tensors as they are.
    with torch.device("meta"):
        fresh = LlamaForCausalLM(clean_config)
    state_dict = gguf_model.state_dict()
    result = fresh.load_state_dict(state_dict, strict=False, assign=True)
    fresh.tie_weights()
    missing = [
        k
        for k in result.missing_keys
        if not (k == "lm_head.weight" and clean_config.tie_word_embeddings)
    ]
    if missing or result.unexpected_keys:
        raise ConversionError(
            f"weights do not match the config: missing={missing} "
            f"unexpected={list(result.unexpected_keys)}"
        )
    meta = [name for name, p in fresh.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ConversionError(f"parameters left uninitialised: {meta}")
    fresh.eval()
    return fresh


def _generation_config(tokenizer: Any, model_config: Any) -> Any:
    """Build a generation config whose special token ids come from the tokenizer."""
    from transformers import GenerationConfig

    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    bos_id = tokenizer.bos_token_id
    return GenerationConfig(
        bos_token_id=bos_id if bos_id is not None else model_config.bos_token_id,
        eos_token_id=eos_id if eos_id is not None else model_config.eos_token_id,
        pad_token_id=pad_id,
    )


def greedy_chat_answer(model_dir: Path, question: str) -> str:
    """Load ``model_dir`` with transformers and return the greedy chat answer to ``question``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    # The chat template already holds every special token the model expects.
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def write_hf_folder(gguf_path: Path, target: Path, step: Step) -> dict[str, Any]:
    """Write config, weights, tokenizer and generation config of ``gguf_path`` into ``target``
    (each stage timed by ``step``); return the token ids and parameter count for the marker."""
    tokenizer, gguf_model = _load_from_gguf(gguf_path, step)
    if not getattr(tokenizer, "chat_template", None):
        raise ConversionError("the GGUF tokenizer carries no chat template")

    with step("rebuilding a serialisable LlamaForCausalLM"):
        model = _rebuild_serializable(gguf_model)
        del gguf_model
        model.generation_config = _generation_config(tokenizer, model.config)

    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len:
        # GGUF tokenizers come with a "very large" model_max_length; the real context is known.
        tokenizer.model_max_length = int(max_len)

    with step(f"saving safetensors weights and config to {target}"):
        model.save_pretrained(str(target), safe_serialization=True)
    with step("saving tokenizer and chat template"):
        tokenizer.save_pretrained(str(target))
    for file in target.iterdir():
        # The weights come out owner-only (written through a temp file); the folder is a shared
        # read-only asset, so make every file world-readable like the rest of the checkout.
        if file.is_file():
            file.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "bos_token_id": model.generation_config.bos_token_id,
        "eos_token_id": model.generation_config.eos_token_id,
        "pad_token_id": model.generation_config.pad_token_id,
        "parameters": n_params,
    }
