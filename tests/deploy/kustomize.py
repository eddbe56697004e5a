"""The part of kustomize that ``deploy/kubernetes`` uses, in Python, for machines without kubectl.

Supported (and all that the manifests use): ``resources`` (files and kustomization folders),
``labels`` (``pairs``, metadata only, as kustomize does without ``includeSelectors``),
``configMapGenerator`` (``files``; ``behavior`` create, merge or replace), ``generatorOptions``
with ``disableNameSuffixHash: true`` (name hashes are not reproduced), ``patches`` (strategic
merge patches from ``path``: maps merge, lists of named items merge by ``name``) and ``images``
(``newName``, ``newTag``). Anything else raises, so the manifests cannot silently outgrow it;
where kubectl exists the tests compare both renderings.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]
_KNOWN = {
    "apiVersion",
    "kind",
    "resources",
    "labels",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "images",
}


def _key(obj: Object) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of ``patch`` into ``base`` (a copy): maps by key, named lists by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    is_named = isinstance(base, list) and isinstance(patch, list)
    is_named = is_named and all(isinstance(item, dict) and "name" in item for item in base + patch)
    if is_named:
        merged_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            index = next((i for i, old in enumerate(base) if old["name"] == item["name"]), None)
            if index is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[index] = merge(base[index], item)
        return merged_list
    return copy.deepcopy(patch)


def _containers(obj: Object) -> list[Object]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def render(folder: Path) -> list[Object]:
    """Every object the kustomization in ``folder`` produces."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN
    if unknown:
        raise NotImplementedError(f"{folder}: kustomize fields not supported here: {unknown}")
    objects: list[Object] = []
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in spec.get("configMapGenerator", []):
        if not spec.get("generatorOptions", {}).get("disableNameSuffixHash"):
            raise NotImplementedError("name suffix hashes are not reproduced here")
        data = {Path(f).name: (folder / f).read_text() for f in generator.get("files", [])}
        behavior = generator.get("behavior", "create")
        existing = next((o for o in objects if _key(o) == ("ConfigMap", generator["name"])), None)
        if behavior == "create":
            if existing is not None:
                raise ValueError(f"ConfigMap {generator['name']} generated twice")
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": generator["name"]},
                    "data": data,
                }
            )
        elif existing is None:
            raise ValueError(f"behavior {behavior} on a ConfigMap the base does not make")
        elif behavior == "merge":
            existing["data"] = {**existing.get("data", {}), **data}
        else:
            existing["data"] = data
    for patch_spec in spec.get("patches", []):
        if set(patch_spec) != {"path"}:
            raise NotImplementedError(f"only path patches are supported: {patch_spec}")
        patch = yaml.safe_load((folder / patch_spec["path"]).read_text())
        index = next(i for i, o in enumerate(objects) if _key(o) == _key(patch))
        objects[index] = merge(objects[index], patch)
    for label_set in spec.get("labels", []):
        if set(label_set) != {"pairs"}:
            raise NotImplementedError(f"only plain label pairs are supported: {label_set}")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for image in spec.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    name = image.get("newName", name)
                    container["image"] = f"{name}:{image.get('newTag', tag)}".rstrip(":")
    return objects
