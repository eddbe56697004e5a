"""deploy/kubernetes and the Dockerfile, checked against the Kubernetes schemas and the apps.

No cluster or Docker engine runs here, so this tests what can be tested: each overlay renders
(``tests/deploy/kustomize.py``; equal to ``kubectl kustomize`` where kubectl exists), every
object validates against the schemas of a pinned Kubernetes version, and the manifests agree
with the code: the commands are the apps' entry points with flags they take, the probes hit
paths the apps serve on the ports they bind, the config files exist in the ConfigMap where the
command reads them and validate with the apps' schemas, the gateway's DNS names are the
servers' headless Services, and jumper keys come from a Secret, never a ConfigMap.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import kubernetes_validate
import pytest
import yaml

from client.config.schema import ClientConfig
from server.continuous_batching.cb_server_config import CBServerConfig
from server.static_batching.config import SBServerConfig
from tests.deploy.kustomize import render

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
#: The Kubernetes version the manifests are validated for (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ["cpu", "gpu"]
#: The app each entry point serves, with the schema of its config file.
APPS: dict[str, Any] = {
    "client_app.py": ClientConfig,
    "continuous_batching_server_app.py": CBServerConfig,
    "static_batching_server_app.py": SBServerConfig,
}

Object = dict[str, Any]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Object]]:
    """An overlay's name and its rendered objects."""
    return request.param, render(DEPLOY / "overlays" / request.param)


@pytest.fixture(autouse=True)
def jumper_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's pod gets its jumper key from the Secret (the config names the variable)."""
    monkeypatch.setenv("OPENAI_API_KEY_0", "sk-from-the-secret")


def _find(objects: list[Object], kind: str, name: str) -> Object:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _deployments(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] == "Deployment"]


def _config_files(objects: list[Object]) -> dict[str, str]:
    return _find(objects, "ConfigMap", "llm-suite-configs")["data"]


def _served_paths(script: str, config_text: str, tmp_path: Path) -> set[str]:
    """The paths the app of ``script`` serves (its OpenAPI document), without loading a model."""
    if script == "client_app.py":
        from client_app import build_app

        path = tmp_path / "client_config.json"
        path.write_text(config_text)
        return set(build_app(str(path)).openapi()["paths"])
    from server.common.app import create_server_app
    from server.common.service import ServingSettings

    app = create_server_app(MagicMock(), ServingSettings(served_model_names=["m"]))
    return set(app.openapi()["paths"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to compare with")
def test_python_rendering_equals_kubectl_kustomize(overlay: tuple[str, list[Object]]) -> None:
    name, objects = overlay
    output = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "overlays" / name)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    theirs = [doc for doc in yaml.safe_load_all(output) if doc]

    def keyed(docs: list[Object]) -> dict[tuple[str, str], Object]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(objects) == keyed(theirs)


def test_every_object_validates_against_the_kubernetes_schemas(
    overlay: tuple[str, list[Object]],
) -> None:
    _, objects = overlay
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Job"} <= kinds
    assert "PersistentVolumeClaim" in kinds
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@functools.cache
def _usage_of(script: str) -> str:
    """What ``python <script> --help`` prints: the options its parser really takes."""
    result = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


def test_commands_probes_and_configs_match_the_apps(
    overlay: tuple[str, list[Object]], tmp_path: Path
) -> None:
    _, objects = overlay
    files = _config_files(objects)
    for deployment in _deployments(objects):
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        python, script, *args = container["command"]
        assert python == "python" and script in APPS, container["command"]
        source = (REPO_ROOT / script).read_text()
        assert 'if __name__ == "__main__":' in source
        options = dict(zip(args[::2], args[1::2], strict=True))
        assert set(options) == {"--config", "--host", "--port"}
        usage = _usage_of(script)
        for flag in options:  # flags the entry point's parser really takes
            assert re.search(rf"(^|\s|\[){flag}\b", usage), (script, flag, usage)
        assert options["--host"] == "0.0.0.0"  # reachable from other pods, not 127.0.0.1
        port = int(options["--port"])
        assert [p["containerPort"] for p in container["ports"]] == [port]
        # The config is in the ConfigMap, mounted where the command reads it, and validates.
        config_path = Path(options["--config"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        mount = mounts[str(config_path.parent)]
        assert volumes[mount["name"]]["configMap"]["name"] == "llm-suite-configs"
        text = files[config_path.name]
        config = APPS[script].model_validate(json.loads(text))
        served = _served_paths(script, text, tmp_path)
        probes = [container.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe")]
        for probe in filter(None, probes):
            assert probe["httpGet"]["port"] == port
            assert probe["httpGet"]["path"] in served
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        if script != "client_app.py":  # the model: on the PVC, mounted read-only
            loading = getattr(config, "model_loading_config", None) or config.worker_config
            model_mount = mounts["/models"]
            assert model_mount["readOnly"] is True
            assert volumes[model_mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
            assert loading.model_name_or_path.startswith("/models/")


def test_gateway_discovers_the_headless_services(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    config = ClientConfig.model_validate_json(_config_files(objects)["client_config.json"])
    for entry, deployment_name in (
        (config.continuous_batching_server_dns, "llm-cb-server"),
        (config.static_batching_server_dns, "llm-sb-server"),
    ):
        assert entry is not None
        service = _find(objects, "Service", entry.name)
        assert service["spec"]["clusterIP"] == "None"  # one A record per ready pod
        assert [p["port"] for p in service["spec"]["ports"]] == [entry.port]
        deployment = _find(objects, "Deployment", deployment_name)
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["ports"][0]["containerPort"] == entry.port
    gateway = _find(objects, "Deployment", "llm-gateway")
    assert gateway["spec"]["replicas"] == 2
    service = _find(objects, "Service", "llm-gateway")
    [gateway_container] = gateway["spec"]["template"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] == 8000
    assert gateway_container["ports"][0]["containerPort"] == 8000
    budget = _find(objects, "PodDisruptionBudget", "llm-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= (
        gateway["spec"]["template"]["metadata"]["labels"].items()
    )


def test_jumper_keys_come_from_a_secret(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    config = json.loads(_config_files(objects)["client_config.json"])
    jumpers = config["openai_jumper_configs"]
    assert jumpers and all(set(j["api_key"]) == {"env"} for j in jumpers)
    gateway = _find(objects, "Deployment", "llm-gateway")
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    for jumper in jumpers:
        assert "secretKeyRef" in env[jumper["api_key"]["env"]]["valueFrom"]
    assert not [o for o in objects if o["kind"] == "Secret"]  # the operator creates it


def test_pods_run_non_root_with_a_read_only_root(overlay: tuple[str, list[Object]]) -> None:
    _, objects = overlay
    for obj in objects:
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_gpu_overlay_gives_cb_servers_a_gpu_and_cuda(overlay: tuple[str, list[Object]]) -> None:
    name, objects = overlay
    cb = _find(objects, "Deployment", "llm-cb-server")
    limits = cb["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    config = CBServerConfig.model_validate_json(_config_files(objects)["cb_server_config.json"])
    is_gpu = name == "gpu"
    assert (limits.get("nvidia.com/gpu") == 1) is is_gpu
    assert config.model_loading_config.device == ("cuda" if is_gpu else "cpu")
    images = {
        c["image"]
        for d in _deployments(objects)
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"llm-serving-suite:{name}"}


def test_dockerfile_copies_what_exists_and_runs_an_entry_point() -> None:
    lines = (REPO_ROOT / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO_ROOT / source).exists(), source
    [cmd] = [line for line in lines if line.startswith("CMD ")]
    command = json.loads(cmd.removeprefix("CMD "))
    gateway = _find(render(DEPLOY / "base"), "Deployment", "llm-gateway")
    assert command == gateway["spec"]["template"]["spec"]["containers"][0]["command"]
    copied = {Path(source).name for sources in copies for source in sources}
    assert set(APPS) <= copied and "tools/" in {s for sources in copies for s in sources}
