"""Every config file the repository ships still loads, configs written to the seed's templates
load too, and the README's table of the CB server's keys is the code's list.

The schemas refuse unknown keys, so a key dropped from a schema without a way for old files to
keep loading fails here first (issue #23: "every existing config file still loads").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from client.config.schema import ClientConfig
from launcher.deployment import Deployment
from server.continuous_batching.cb_server_config import CBServerConfig
from server.embedding.config import EmbeddingServerConfig
from server.static_batching.config import SBServerConfig
from tests.support.paths import REPO_ROOT

#: The schema of each config file, by file name (configs/, deploy/ and the wheel use these).
SCHEMAS: dict[str, type[BaseModel]] = {
    "cb_server_config.json": CBServerConfig,
    "sb_server_config.json": SBServerConfig,
    "embedding_server_config.json": EmbeddingServerConfig,
    "client_config.json": ClientConfig,
    "deployment.json": Deployment,
}

SHIPPED = sorted([*(REPO_ROOT / "configs").glob("*.json"), *(REPO_ROOT / "deploy").rglob("*.json")])

#: The seed's template of cb_server_config.json, its comments taken out: what a user who
#: started from the seed has on disk.
SEED_CB_SERVER_CONFIG: dict[str, Any] = {
    "model_loading_config": {
        "model_type": "llama",
        "model_name_or_path": "PATH_TO_MODEL_DIR",
        "torch_dtype": "float16",
        "tokenizer_name_or_path": None,
        "use_fast_tokenizer": False,
        "trust_remote_code": False,
        "quantize_method": None,
        "model_max_length": 2048,
        "gptq_model_base_name": None,
        "gptq_config_base_name": None,
    },
    "batcher_config": {"batch_max_tokens": 56000, "batch_max_beams": 32},
    "cache_config": {
        "num_blocks": 2500,
        "num_blocks_cpu": 1024,
        "block_size": 16,
        "watermark": 0.01,
    },
}

#: The seed's template of sb_server_config.json (``package_max_workload`` is a string there).
SEED_SB_SERVER_CONFIG: dict[str, Any] = {
    "batcher_config": {"package_max_workload": "16", "packaging_interval_seconds": 2},
    "worker_config": {
        "model_name_or_path": "PATH_TO_MODEL_DIR",
        "tokenizer_name_or_path": None,
        "revision": "main",
        "low_cpu_mem_usage": True,
        "torch_dtype": "float16",
        "use_fast_tokenizer": False,
        "trust_remote_code": False,
        "use_safetensors": False,
        "batch_size": -1,
        "is_gptq_quantized": False,
    },
}


def test_every_config_file_has_a_schema() -> None:
    assert {path.name for path in (REPO_ROOT / "configs").glob("*.json")} == set(SCHEMAS)
    unknown = [str(path) for path in SHIPPED if path.name not in SCHEMAS]
    assert not unknown, f"config files with no schema in this test: {unknown}"


def _secret_variables(value: Any) -> list[str]:
    """The environment variables a config reads its secrets from (``{"env": "NAME"}``)."""
    if isinstance(value, dict):
        if set(value) == {"env"}:
            return [value["env"]]
        return [name for item in value.values() for name in _secret_variables(item)]
    if isinstance(value, list):
        return [name for item in value for name in _secret_variables(item)]
    return []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shipped_config_files_load(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for name in _secret_variables(data):  # as a Kubernetes Secret would set them
        monkeypatch.setenv(name, "a-key")
    SCHEMAS[path.name].model_validate(data)


def test_seed_templates_load_with_their_values() -> None:
    cb = CBServerConfig.model_validate(SEED_CB_SERVER_CONFIG)
    for section, keys in SEED_CB_SERVER_CONFIG.items():
        assert getattr(cb, section).model_dump(include=set(keys)) == keys
    sb = SBServerConfig.model_validate(SEED_SB_SERVER_CONFIG)
    assert sb.batcher_config.package_max_workload == 16
    assert sb.worker_config.is_gptq_quantized is False


def _leaf_defaults(model: type[BaseModel]) -> dict[tuple[str, str], Any]:
    """(section, key) -> default of every key of a two-level config ("required" if none)."""
    leaves: dict[tuple[str, str], Any] = {}
    for section, field in model.model_fields.items():
        section_model = field.annotation
        assert isinstance(section_model, type) and issubclass(section_model, BaseModel)
        for key, leaf in section_model.model_fields.items():
            leaves[(section, key)] = "required" if leaf.is_required() else leaf.default
    return leaves


def _readme_table(title: str) -> dict[tuple[str, str], str]:
    """(section, key) -> default cell of the README table that follows ``title``."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    after = text[text.index(title) :]
    rows: dict[tuple[str, str], str] = {}
    row = re.compile(r"^\| `(\w+)` \| `(\w+)` \| (required|`[^`]*`) \|")
    for line in after.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break  # the end of the table
        match = row.match(line)
        if match:
            section, key, default = match.groups()
            assert (section, key) not in rows, f"{section}.{key} twice in the README table"
            rows[(section, key)] = default.strip("`")
    return rows


def test_readme_table_lists_every_cb_server_key_with_its_default() -> None:
    table = _readme_table("**The CB server's keys**")
    leaves = _leaf_defaults(CBServerConfig)
    assert set(table) == set(leaves)
    for place, default in leaves.items():
        cell = table[place]
        shown = cell if default == "required" else json.loads(cell)
        assert shown == default, f"README shows {cell} for {'.'.join(place)}, the code {default!r}"
    count = re.search(r"all (\d+), a test holds", (REPO_ROOT / "README.md").read_text())
    assert count and int(count.group(1)) == len(leaves)
