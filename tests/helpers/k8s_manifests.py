"""The Kubernetes manifests of deploy/k8s, loaded as objects per component."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.35.0"
MANIFEST_FILES = sorted(
    path for path in K8S_DIR.rglob("*.yaml") if path.name != "kustomization.yaml" and "secrets" not in path.parts
)


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects(directory: Path) -> list[dict[str, Any]]:
    return [doc for path in MANIFEST_FILES if path.parent == directory for doc in load(path)]


REPLICAS = _objects(K8S_DIR / "dit-replicas")
MULTINODE = _objects(K8S_DIR / "dit-multinode")
COMPONENTS = {"dit-replicas": REPLICAS, "dit-multinode": MULTINODE}


TWO_MODELS = _objects(K8S_DIR / "two-models")

# The strategic merge keys of the lists the components patch (Kubernetes' patchMergeKey of each field).
_MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath"}


def _merged(base: Any, patch: Any) -> Any:
    """`patch` applied to `base` as a strategic merge patch does, for the fields the components patch: mappings
    merge, a list of _MERGE_KEYS merges item by item (`$patch: delete` removes one), anything else is replaced."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return patch
    merged = dict(base)
    for key, value in patch.items():
        if key in _MERGE_KEYS and isinstance(value, list):
            items = list(merged.get(key, []))
            for item in value:
                at = [i for i, old in enumerate(items) if old[_MERGE_KEYS[key]] == item[_MERGE_KEYS[key]]]
                if item.get("$patch") == "delete":
                    assert at, f"{key}: nothing to delete at {item}"
                    del items[at[0]]
                elif at:
                    items[at[0]] = _merged(items[at[0]], item)
                else:
                    items.append(item)
            merged[key] = items
        else:
            merged[key] = _merged(merged.get(key), value)
    return merged


def with_component(base: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """The objects of the base with a component's resources added and its patches applied (deletions and strategic
    merge patches; what `kubectl kustomize` builds, less the namespace and the secrets' hashed names)."""
    kustomization = yaml.safe_load((K8S_DIR / component / "kustomization.yaml").read_text())
    objects = copy.deepcopy([*base, *_objects(K8S_DIR / component)])
    for entry in kustomization.get("patches", []):
        assert "target" not in entry, f"{component}: only patches naming their object are applied here"
        patch = yaml.safe_load(entry["patch"])
        at = [
            i
            for i, o in enumerate(objects)
            if (o["kind"], o["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
        ]
        assert len(at) == 1, f"{component}: {patch['kind']}/{patch['metadata']['name']} is not one object"
        if patch.get("$patch") == "delete":
            del objects[at[0]]
        else:
            objects[at[0]] = _merged(objects[at[0]], patch)
    return objects
