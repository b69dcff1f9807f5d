"""The Kubernetes manifests of deploy/k8s, loaded as objects per component."""

from __future__ import annotations

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
