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

from services.environment_options import options_module, parse_args
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.store_location import PostgresLocation, S3Location
from tests.helpers.k8s_manifests import (
    COMPONENTS,
    K8S_DIR,
    KUBERNETES_VERSION,
    _objects,
    is_custom,
    pod_template,
    with_component,
    with_components,
)
from tests.helpers.serving import parse_serve


def _kustomize(tmp_path: Path, components: list[str]) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: install it (its built-in kustomize builds deploy/k8s)")
    root = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, root)
    (root / "secrets" / "cluster-secret").write_text("0123456789abcdef\n")
    shutil.copy(K8S_DIR.parents[0] / "tenants.example.yaml", root / "secrets" / "tenants.yaml")
    for name in ("database-password", "blobs-access-key", "blobs-secret-key"):
        (root / "orchestrator-ha" / "secrets" / name).write_text(f"{name}-value\n")
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


def _pod_shapes(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Each workload's containers (command, environment, model and other mounts) and its volumes but Secrets,
    whose names kustomize hashes (and generated ConfigMaps' names, without their hash)."""
    generated = _generated_config_maps(objects)
    shapes = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            template = pod_template(o)
            pod = template["spec"]
            containers = [
                (
                    c["name"],
                    c["args"],
                    # By name: kustomize puts the entries a patch adds first, which matters only to $(VAR).
                    sorted(
                        (e for e in c.get("env", []) if "secretKeyRef" not in e.get("valueFrom", {})),
                        key=lambda e: e["name"],
                    ),
                    sorted(c.get("volumeMounts", []), key=lambda m: m["mountPath"]),
                )
                for c in pod["containers"]
            ]
            volumes = []
            for volume in sorted((v for v in pod.get("volumes", []) if "secret" not in v), key=lambda v: v["name"]):
                if "configMap" in volume:
                    name = volume["configMap"]["name"]
                    volume = volume | {"configMap": volume["configMap"] | {"name": generated.get(name, name)}}
                volumes.append(volume)
            labels = template["metadata"]["labels"]
            shapes[o["metadata"]["name"]] = (containers, volumes, labels, "replicas" in o["spec"])
    return shapes


def _generated_config_maps(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The names kustomize generated for ConfigMaps (NAME-HASH) -> NAME."""
    return {
        o["metadata"]["name"]: o["metadata"]["name"].rsplit("-", 1)[0]
        for o in objects
        if o["kind"] == "ConfigMap" and re.fullmatch(r"[a-z0-9-]+-[a-z0-9]{10}", o["metadata"]["name"])
    }


def _names(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    generated = _generated_config_maps(objects)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "Secret"}
    return {(kind, generated.get(name, name)) for kind, name in names}


def test_the_two_models_component_builds_what_the_unit_tier_checks(tmp_path: Path) -> None:
    """`components: [two-models]` built by kubectl: valid objects, and the same objects, commands, mounts, volumes and
    flags as the patches applied by tests/helpers/k8s_manifests.py, which tests/unit/test_k8s_manifests.py checks."""
    objects = _kustomize(tmp_path, ["two-models"])
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    expected = with_component(_objects(K8S_DIR), "two-models")
    names = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "Secret"}
    assert names == {(o["kind"], o["metadata"]["name"]) for o in expected}
    assert _pod_shapes(objects) == _pod_shapes(expected)
    (flags,) = [o["data"] for o in objects if o["kind"] == "ConfigMap"]
    assert flags == next(o["data"] for o in expected if o["kind"] == "ConfigMap")
    assert flags["DIT_ENDPOINTS"] == "dns:dit-pods:50062,dns:dit-i2v-pods:50062"


def test_the_orchestrator_ha_component_runs_replicas_on_shared_storage(tmp_path: Path) -> None:
    """`components: [orchestrator-ha]`: two orchestrators on the database and bucket its ConfigMap names, rolled
    one at a time, with no ReadWriteOnce volume; their command, run through a real shell with the pod's
    environment, is one the orchestrator accepts."""
    objects = _kustomize(tmp_path, ["orchestrator-ha"])
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("PersistentVolumeClaim", "stagediff-state") not in kinds
    assert any(o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "orchestrator" for o in objects)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "orchestrator"]
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = spec["template"]["spec"]
    assert all("persistentVolumeClaim" not in volume for volume in pod["volumes"])
    (container,) = pod["containers"]
    argv = _shell_argv(container, objects)
    args = parse_serve(argv)
    config = OrchestratorConfig.from_options(args)
    assert isinstance(config.store, PostgresLocation) and isinstance(config.blobs, S3Location)
    assert config.advertise == "10.1.2.3:50051"
    assert pod["terminationGracePeriodSeconds"] > config.drain_grace_s
    secrets = {
        ref["secretKeyRef"]["name"]
        for env in container["env"]
        if (ref := env.get("valueFrom", {})) and "secretKeyRef" in ref
    }
    assert {name.rsplit("-", 1)[0] for name in secrets} >= {"stagediff-database", "stagediff-blobs"}


def _shell_argv(container: dict[str, Any], objects: list[dict[str, Any]]) -> list[str]:
    """The container's `stagediff serve` arguments, as its /bin/sh passes them, in a pod whose IP is 10.1.2.3."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    environment: dict[str, str] = {"PATH": "/usr/bin:/bin"}
    for entry in container["env"]:
        source = entry.get("valueFrom", {})
        if "configMapKeyRef" in source:
            value = maps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in source:
            value = "secret"
        elif "fieldRef" in source:
            value = {"status.podIP": "10.1.2.3"}[source["fieldRef"]["fieldPath"]]
        else:  # kubelet expands $(VAR) of variables defined before
            value = re.sub(r"\$\((\w+)\)", lambda found: environment[found[1]], entry["value"])
        environment[entry["name"]] = value
    (script,) = container["args"]
    assert script.startswith("exec stagediff serve "), script
    printed = subprocess.run(
        ["/bin/sh", "-c", "stagediff() { printf '%s\\0' \"$@\"; }; " + script.removeprefix("exec ")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert printed.returncode == 0, printed.stderr
    argv = printed.stdout.split("\0")[:-1]
    assert argv[0] == "serve"
    return argv[1:]


@pytest.mark.parametrize(
    "components",
    [["autoscaling"], ["two-models", "autoscaling/two-models"], ["dit-lws"], ["dit-lws", "autoscaling/dit-lws"]],
    ids="+".join,
)
def test_the_autoscaling_and_lws_components_build_what_the_unit_tier_checks(
    tmp_path: Path, components: list[str]
) -> None:
    """Each way to enable autoscaling and LeaderWorkerSet groups, built by kubectl: valid objects (custom resources
    aside: no schema here), and the same objects, pod templates, ConfigMaps and ScaledObjects as the components applied
    by tests/helpers/k8s_manifests.py, which tests/unit/test_k8s_manifests.py checks."""
    objects = _kustomize(tmp_path, components)
    for obj in objects:
        if not is_custom(obj):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    expected = with_components(_objects(K8S_DIR), components)
    assert _names(objects) == {(o["kind"], o["metadata"]["name"]) for o in expected}
    assert _pod_shapes(objects) == _pod_shapes(expected)
    generated = _generated_config_maps(objects)
    for kind in ("ConfigMap", "ScaledObject", "LeaderWorkerSet"):
        built = {generated.get(o["metadata"]["name"], o["metadata"]["name"]): o for o in objects if o["kind"] == kind}
        wanted = {o["metadata"]["name"]: o for o in expected if o["kind"] == kind}
        assert set(built) == set(wanted), kind
        for name, obj in built.items():
            field = "data" if kind == "ConfigMap" else "spec"
            assert obj[field] == wanted[name][field], f"{kind}/{name}"


def test_autoscaling_composes_with_replicated_orchestrators(tmp_path: Path) -> None:
    """`components: [orchestrator-ha, autoscaling]`: the replicas' own command (orchestrator-ha's) with the cold-start
    timeout of the autoscaling component's environment, as a real shell and the orchestrator's parser read them."""
    objects = _kustomize(tmp_path, ["orchestrator-ha", "autoscaling"])
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "orchestrator"]
    assert deployment["spec"]["replicas"] >= 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = _shell_argv(container, objects)
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    environ = {
        entry["name"]: maps[ref["name"]][ref["key"]]
        for entry in container["env"]
        if entry["name"].startswith("STAGEDIFF_") and (ref := entry.get("valueFrom", {}).get("configMapKeyRef"))
    }
    assert environ == {"STAGEDIFF_COLD_START_TIMEOUT": "1200"}
    args = parse_args(options_module(argv[0]).build_parser(), argv[1:], environ)
    config = OrchestratorConfig.from_options(args)
    assert config.cold_start_timeout_s == 1200 and isinstance(config.store, PostgresLocation)
    assert args.dit == "dns:dit-pods:50062"
