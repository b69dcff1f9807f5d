"""deploy/k8s: every manifest is a valid Kubernetes object, and every container runs a command the code accepts.

No cluster is needed: the manifests are checked against the API schemas that kubernetes-validate bundles,
and each container's command line goes through the real argparse parser of the service it starts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.helpers.k8s_manifests import COMPONENTS, K8S_DIR, KUBERNETES_VERSION


def _kustomize(tmp_path: Path, components: list[str]) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: install it (its built-in kustomize builds deploy/k8s)")
    root = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, root)
    (root / "secrets" / "cluster-secret").write_text("0123456789abcdef\n")
    shutil.copy(K8S_DIR.parents[0] / "tenants.example.yaml", root / "secrets" / "tenants.yaml")
    if components:
        with (root / "kustomization.yaml").open("a") as file:
            file.write(yaml.safe_dump({"components": components}))
    built = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.mark.parametrize("components", [[], ["dit-replicas"], ["dit-multinode"]], ids=["base", *COMPONENTS])
def test_kustomize_builds(tmp_path: Path, components: list[str]) -> None:
    objects = _kustomize(tmp_path, components)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"stagediff"}
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert (("StatefulSet", "dit") in names) == (components == ["dit-replicas"])
    assert (("StatefulSet", "dit-group") in names) == (components == ["dit-multinode"])
    assert (("Deployment", "dit") in names) != bool(components)
    assert (("Service", "dit") in names) != bool(components)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    rendered = yaml.safe_dump_all(objects)
    for secret in secrets:  # the generated names (with their hash) replaced every reference
        assert re.fullmatch(r"stagediff-(cluster-secret|tenants)-[a-z0-9]+", secret), secret
    assert "name: stagediff-cluster-secret\n" not in rendered and "secretName: stagediff-tenants\n" not in rendered
