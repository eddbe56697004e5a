"""The CB server's model_loading_config keys are honoured or refused by name (no model loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server.continuous_batching import engine
from server.continuous_batching.cb_server_config import load_cb_server_config
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model.weights import load_model
from utils.config import ConfigError

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def checkpoint(folder: Path, **config: object) -> Path:
    """A model folder holding only a config.json (enough for the checks before the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def server_config(tmp_path: Path, **loading: object) -> Path:
    path = tmp_path / "cb_server_config.json"
    path.write_text(json.dumps({"model_loading_config": loading}))
    return path


def test_unsupported_model_type_is_refused_naming_key_and_family(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m", model_type="llama", **TINY_LLAMA)
    path = server_config(tmp_path, model_name_or_path=str(folder), model_type="gpt2")
    with pytest.raises(ConfigError) as error:
        load_cb_server_config(path)
    message = str(error.value)
    assert f"{path}: model_loading_config.model_type:" in message
    assert "'gpt2' is not supported" in message and "llama, mistral, qwen2" in message


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_llama_family_checkpoints_are_accepted(tmp_path: Path, model_type: str) -> None:
    folder = checkpoint(tmp_path / "m", model_type=model_type, **TINY_LLAMA)
    path = server_config(tmp_path, model_name_or_path=str(folder), model_type="llama")
    assert load_cb_server_config(path).model_loading_config.model_type == "llama"


def test_checkpoint_outside_the_family_is_refused_at_start_up(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    path = server_config(tmp_path, model_name_or_path=str(folder))
    with pytest.raises(ConfigError) as error:
        load_cb_server_config(path)
    message = str(error.value)
    assert f"{path}: model_loading_config.model_type is 'auto'" in message
    assert "model_type 'gpt2'" in message and "gemma3_text" in message


def test_load_model_checks_the_checkpoint_model_type(tmp_path: Path) -> None:
    # Engines built without a config file (tests, benchmarks) get the same check at load.
    folder = checkpoint(tmp_path / "m", model_type="gemma2", **TINY_LLAMA)
    config = ModelLoadingConfig(
        model_name_or_path=str(folder), model_type="llama", torch_dtype="float32"
    )
    with pytest.raises(ValueError, match="model_loading_config.model_type is 'llama'"):
        load_model(config)


@pytest.mark.parametrize(
    ("use_fast", "trust_remote_code", "tokenizer_dir"),
    [(False, True, None), (True, False, "tok")],
)
def test_tokenizer_options_reach_auto_tokenizer(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    use_fast: bool,
    trust_remote_code: bool,
    tokenizer_dir: str | None,
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def from_pretrained(path: str, **kwargs: Any) -> object:
        calls.append((str(path), kwargs))
        return object()

    monkeypatch.setattr(engine.AutoTokenizer, "from_pretrained", from_pretrained)
    tokenizer_path = str(tmp_path / tokenizer_dir) if tokenizer_dir else None
    config = ModelLoadingConfig(
        model_name_or_path=str(tmp_path),
        tokenizer_name_or_path=tokenizer_path,
        use_fast_tokenizer=use_fast,
        trust_remote_code=trust_remote_code,
    )
    engine.load_tokenizer(config)
    ((path, kwargs),) = calls
    assert path == (tokenizer_path or str(tmp_path))
    assert kwargs["use_fast"] is use_fast and kwargs["trust_remote_code"] is trust_remote_code


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("/m/llama-3-8b-q4_k_m.gguf", "llama-3-8b"),
        ("/m/tiny.BF16.gguf", "tiny"),
        ("/m/plain.gguf", "plain"),
        ("models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ],
)
def test_served_model_id_drops_the_gguf_file_name(path: str, served: str) -> None:
    assert ModelLoadingConfig(model_name_or_path=path).served_model_id == served
    named = ModelLoadingConfig(model_name_or_path=path, served_model_name="mine")
    assert named.served_model_id == "mine"
