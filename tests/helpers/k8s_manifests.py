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
        if value is None:  # `key: null` deletes the field
            merged.pop(key, None)
        elif key in _MERGE_KEYS and isinstance(value, list):
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
    """The objects of the base with a component applied as kustomize applies it: its resources added, the components
    it includes applied, its ConfigMaps generated and its patches applied (deletions and strategic merge patches;
    what `kubectl kustomize` builds, less the namespace and the hashes in generated names)."""
    directory = K8S_DIR / component
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = copy.deepcopy([*base, *_objects(directory)])
    for included in kustomization.get("components", []):
        objects = with_component(objects, str((directory / included).resolve().relative_to(K8S_DIR)))
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for source in generator["files"]:
            key, _, path = source.rpartition("=")
            data[key or Path(path).name] = (directory / path).read_text()
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for entry in kustomization.get("patches", []):
        if "target" in entry:  # a JSON patch (RFC 6902) of the object the target names
            target = entry["target"]
            assert set(target) == {"kind", "name"}, f"{component}: a target names one object here: {target}"
            named = (target["kind"], target["name"])
            at = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == named]
            assert len(at) == 1, f"{component}: {target} is not one object"
            for operation in yaml.safe_load(entry["patch"]):
                _json_patch(objects[at[0]], operation)
            continue
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


def _json_patch(obj: dict[str, Any], operation: dict[str, Any]) -> None:
    """One operation of a JSON patch: test, replace, add or remove at a JSON pointer."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    container: Any = obj
    for part in parents:
        container = container[int(part)] if isinstance(container, list) else container[part]
    key: Any = last if isinstance(container, dict) else (len(container) if last == "-" else int(last))
    op = operation["op"]
    if op == "test":
        assert container[key] == operation["value"], f"JSON patch test failed at {operation['path']}"
    elif op == "replace":
        assert isinstance(container, dict) and key in container or isinstance(container, list) and key < len(container)
        container[key] = copy.deepcopy(operation["value"])
    elif op == "add":
        if isinstance(container, list):
            container.insert(key, copy.deepcopy(operation["value"]))
        else:
            container[key] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del container[key]
    else:
        raise AssertionError(f"JSON patch operation {op} is not applied here")


def with_components(base: list[dict[str, Any]], components: list[str]) -> list[dict[str, Any]]:
    """The base with `components` applied in order, as `components:` in deploy/k8s/kustomization.yaml lists them."""
    for component in components:
        base = with_component(base, component)
    return base


# Kinds whose schemas kubernetes-validate does not have (custom resources): tests/unit/test_k8s_manifests.py checks
# them field by field.
CUSTOM_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1"}


def is_custom(obj: dict[str, Any]) -> bool:
    return obj["kind"] in CUSTOM_KINDS


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment, a StatefulSet or a LeaderWorkerSet (whose leaders use its worker template)."""
    if workload["kind"] == "LeaderWorkerSet":
        template = workload["spec"]["leaderWorkerTemplate"]
        assert "leaderTemplate" not in template, "one template for leader and workers: the rank comes from LWS"
        return template["workerTemplate"]
    return workload["spec"]["template"]
