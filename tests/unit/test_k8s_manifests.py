"""deploy/k8s: every manifest is a valid Kubernetes object, and every container runs a command the code accepts.

No cluster is needed: the manifests are checked against the API schemas that kubernetes-validate bundles (custom
resources, KEDA's ScaledObjects and LWS's LeaderWorkerSet, by the Kubernetes types they embed and field by field),
and each container's command line goes through the real argparse parser of the service it starts.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services.environment_options import options_module, parse_args
from services.stage_table import STAGES as STAGE_KINDS
from tests.helpers.compose import dit_world_size, gateway_refusal
from tests.helpers.k8s_manifests import (
    COMPONENTS,
    CUSTOM_KINDS,
    K8S_DIR,
    KUBERNETES_VERSION,
    MANIFEST_FILES,
    MULTINODE,
    REPLICAS,
    _objects,
    is_custom,
    load,
    pod_template,
    with_component,
    with_components,
)
from tests.helpers.metric_names import metrics_read, unknown_metrics
from tests.helpers.secure_defaults import startup_refusal
from tests.helpers.serving import parse_serve

FLAGS_CONFIGMAP = "stagediff-flags"
CLUSTER_SECRET_ENV = "STAGEDIFF_CLUSTER_SECRET"
MODEL_DIR = "/models/model"
STAGES = ("text-encoder", "dit", "vae", "interp")


# `stagediff serve http`: the HTTP gateway, a client of the orchestrator's public port (no stage, no secret).
GATEWAY = "http"


# A large checkpoint loads for minutes: the startup probe must allow at least this long.
MIN_STARTUP_S = 600
KUSTOMIZATIONS = sorted(K8S_DIR.rglob("kustomization.yaml"))
BASE = _objects(K8S_DIR)


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: expected one, found {len(found)}"
    return found[0]


def _flags(component: str | None = None) -> dict[str, str]:
    """The stagediff-flags ConfigMap's data, with a component's patch applied if one is named."""
    data = dict(_one(BASE, "ConfigMap", FLAGS_CONFIGMAP)["data"])
    if component:
        kustomization = yaml.safe_load((K8S_DIR / component / "kustomization.yaml").read_text())
        for entry in kustomization.get("patches", []):
            patch = yaml.safe_load(entry["patch"])
            if patch.get("kind") == "ConfigMap" and patch["metadata"]["name"] == FLAGS_CONFIGMAP:
                data.update(patch["data"])
    return data


def _validate(obj: dict[str, Any], where: str = "") -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{where}{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    """Every object in strict mode; a custom resource (KEDA's, LWS's), which kubernetes-validate has no schema for,
    by the Kubernetes types it embeds (test_custom_resources_embed_valid_kubernetes_types)."""
    docs = load(path)
    assert docs, f"{path}: no objects"
    for doc in docs:
        if is_custom(doc):
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]], f"{path.name}: {doc['kind']}"
            continue
        _validate(doc, f"{path.name}: ")


def test_validation_catches_a_typo() -> None:
    """Strict mode is on: an unknown field fails, rather than passing silently."""
    deployment = yaml.safe_load(yaml.safe_dump(_one(BASE, "Deployment", "dit")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_kustomization_lists_every_manifest(path: Path) -> None:
    kustomization = yaml.safe_load(path.read_text())
    listed = set(kustomization.get("resources", []))
    present = {p.name for p in MANIFEST_FILES if p.parent == path.parent}
    assert listed == present, f"{path}: resources {sorted(listed)} but the folder holds {sorted(present)}"


def test_secrets_come_from_git_ignored_files() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    generated = {entry["name"]: entry["files"] for entry in kustomization["secretGenerator"]}
    assert set(generated) == {"stagediff-cluster-secret", "stagediff-tenants"}
    for files in generated.values():
        for source in files:
            assert source.partition("=")[2].startswith("secrets/"), source
    assert (K8S_DIR / "secrets" / ".gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]
    committed = [doc for path in MANIFEST_FILES for doc in load(path)]
    assert not any(o["kind"] == "Secret" for o in committed), "a Secret is committed"


POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
NAMESPACE = "stagediff"


def _env_values(container: dict[str, Any], flags: dict[str, str], pod_index: int = 0) -> dict[str, str]:
    values = {}
    for entry in container.get("env", []):
        if "value" in entry:
            values[entry["name"]] = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_FIELD, entry
            values[entry["name"]] = str(pod_index)
        elif "configMapKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == FLAGS_CONFIGMAP, entry
            assert ref["key"] in flags, f"{entry['name']}: no key {ref['key']} in the {FLAGS_CONFIGMAP} ConfigMap"
            values[entry["name"]] = flags[ref["key"]]
    return values


def command_argv(
    container: dict[str, Any], flags: dict[str, str], pod_index: int = 0, kubelet_env: dict[str, str] | None = None
) -> list[str]:
    """The container's `stagediff serve` arguments, as its shell would pass them (in pod number `pod_index`);
    `kubelet_env`: the variables kubelet replaces $(VAR) with before the shell runs (those LWS sets)."""
    assert container["command"] == ["/bin/sh", "-c"], container["name"]
    (script,) = container["args"]
    for name, value in (kubelet_env or {}).items():
        assert " " not in value, f"$({name}) would be one argument, whatever it holds"
        script = script.replace(f"$({name})", value)
    assert "$(" not in script, "kubelet would expand $(VAR) itself, as one argument"
    words = shlex.split(script)
    assert words[:3] == ["exec", "stagediff", "serve"], script
    env = _env_values(container, flags, pod_index)
    argv = []
    for word in words[3:]:
        if "$" not in word:
            argv.append(word)
            continue
        variable = re.fullmatch(r"\$(\w+)", word)
        assert variable, f"{word}: only a whole $VAR word is expanded"
        assert variable[1] in env, f"{word}: not in the container's env"
        argv.extend(shlex.split(env[variable[1]]))  # unquoted in the script: the shell splits it likewise
    return argv


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workloads running StageDiff (the image `stagediff`; not the autoscaling's Prometheus)."""
    return [
        o
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")
        and all(c["image"].partition(":")[0] == "stagediff" for c in pod_template(o)["spec"]["containers"])
    ]


def lws_env(workload: dict[str, Any], worker_index: int = 0, group: int = 0) -> dict[str, str]:
    """What LWS sets in every container of pod `worker_index` of group `group` (its leader's DNS name through the
    headless Service LWS makes, named after the set)."""
    if workload["kind"] != "LeaderWorkerSet":
        return {}
    name = workload["metadata"]["name"]
    return {
        "LWS_GROUP_SIZE": str(workload["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": str(worker_index),
        "LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{NAMESPACE}",
    }


def _parse(argv: list[str], env: dict[str, str]) -> Any:
    """`stagediff serve ...` parsed as in the container: by its parser, over the STAGEDIFF_* variables it has."""
    environ = {key: value for key, value in env.items() if key.startswith("STAGEDIFF_")}
    try:
        return parse_args(options_module(argv[0]).build_parser(), argv[1:], environ)
    except SystemExit as error:
        pytest.fail(f"stagediff serve {shlex.join(argv)} with {environ}: rejected by its parser (exit {error.code})")


def _containers(flags: dict[str, str], objects: list[dict[str, Any]]):
    for workload in _workloads(objects):
        pod = pod_template(workload)["spec"]
        for container in pod["containers"]:
            argv = command_argv(container, flags, kubelet_env=lws_env(workload))
            yield workload, pod, container, argv[0], _parse(argv, _env_values(container, flags))


def _case_flags(component: str | None, objects: list[dict[str, Any]]) -> dict[str, str]:
    """The stagediff-flags ConfigMap of a case: a built case's own, else the base's with the component's patch."""
    built = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == FLAGS_CONFIGMAP]
    return dict(built[0]["data"]) if built else _flags(component)


CASES = [(None, BASE), ("dit-replicas", REPLICAS), ("dit-multinode", MULTINODE)]
CASE_IDS = ["base", *COMPONENTS]
# The two-models component changes the base's stages: the whole cluster it builds (test_two_models_* below).
TWO_MODELS_BUILT = with_component(BASE, "two-models")
# Builds of several components, as `components:` lists them (the autoscaled ones and dit-lws: tests below).
BUILDS = {
    "autoscaling": ["autoscaling"],
    "two-models+autoscaling": ["two-models", "autoscaling/two-models"],
    "dit-lws": ["dit-lws"],
    "dit-lws+autoscaling": ["dit-lws", "autoscaling/dit-lws"],
}  # with orchestrator-ha, whose command needs a real shell: tests/integration/test_k8s_manifests_processes.py
BUILT = {name: with_components(BASE, components) for name, components in BUILDS.items()}
AUTOSCALED = [name for name in BUILDS if "autoscaling" in name]
WHOLE_CASES = [*CASES, ("two-models", TWO_MODELS_BUILT), *((name, BUILT[name]) for name in BUILDS)]
WHOLE_CASE_IDS = [*CASE_IDS, "two-models", *BUILDS]


def test_each_stage_has_one_workload() -> None:
    stages = [c[3] for c in _containers(_flags(), BASE)]
    assert sorted(stages) == sorted([*STAGES, "orchestrator", GATEWAY])
    for component, objects in COMPONENTS.items():
        assert [c[3] for c in _containers(_flags(component), objects)] == ["dit"]


def _gpus(container: dict[str, Any]) -> int:
    return int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize(("component", "objects"), WHOLE_CASES, ids=WHOLE_CASE_IDS)
def test_gpus_match_each_stage_group(component: str | None, objects: list[dict[str, Any]]) -> None:
    for _, _, container, stage, args in _containers(_case_flags(component, objects), objects):
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), stage
        if stage in ("orchestrator", GATEWAY):
            assert _gpus(container) == 0
        elif stage == "dit":  # the service spawns one rank per GPU of the pod, on each of its nodes
            assert _gpus(container) * args.nnodes == dit_world_size(args)
        elif stage == "vae":
            assert _gpus(container) == args.vae_patch_parallel_size
        else:
            assert _gpus(container) == 1, stage


def test_gpu_check_can_fail() -> None:
    """A ConfigMap asking for a larger group than the pod's GPUs is caught."""
    flags = _flags() | {"DIT_ARGS": "--ulysses-degree 4 --cfg-parallel-size 2"}
    dit = next(c for c in _containers(flags, BASE) if c[3] == "dit")
    assert _gpus(dit[2]) != dit_world_size(dit[4])


def test_unknown_flag_is_rejected() -> None:
    with pytest.raises(pytest.fail.Exception, match="rejected by its parser"):
        parse_serve(["dit", "--model", MODEL_DIR, "--no-such-flag", "2"])


@pytest.mark.parametrize(("component", "objects"), WHOLE_CASES, ids=WHOLE_CASE_IDS)
def test_grpc_probes_on_the_serving_port(component: str | None, objects: list[dict[str, Any]]) -> None:
    for _, _, container, stage, args in _containers(_case_flags(component, objects), objects):
        if stage == GATEWAY:  # HTTP: test_the_gateway_is_ready_when_its_orchestrator_answers
            continue
        assert args.port in {p["containerPort"] for p in container["ports"]}, stage
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": args.port}, f"{stage} {probe}"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S, stage


@pytest.mark.parametrize(("component", "objects"), WHOLE_CASES, ids=WHOLE_CASE_IDS)
def test_a_stage_pod_outlives_its_drain(component: str | None, objects: list[dict[str, Any]]) -> None:
    """On SIGTERM a stage's calls in flight run on for its --drain-grace: the kubelet must wait longer before
    it kills the pod, or an upgrade cuts the calls it meant to let finish."""
    for _, pod, _, stage, args in _containers(_case_flags(component, objects), objects):
        if stage in STAGE_KINDS:
            assert pod["terminationGracePeriodSeconds"] >= args.drain_grace + 10, stage


@pytest.mark.parametrize(("component", "objects"), CASES, ids=CASE_IDS)
def test_cluster_secret_model_and_shm(component: str | None, objects: list[dict[str, Any]]) -> None:
    for _, pod, container, stage, args in _containers(_flags(component), objects):
        secret = [e for e in container["env"] if e["name"] == CLUSTER_SECRET_ENV]
        if stage == GATEWAY:  # a client of the public port: the tenants' keys, never the cluster secret
            assert not secret and not container.get("volumeMounts"), stage
            continue
        assert secret and secret[0]["valueFrom"]["secretKeyRef"]["name"] == "stagediff-cluster-secret", stage
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        if stage == "orchestrator":
            continue
        if not STAGE_KINDS[stage].reads_checkpoint:  # the interpolator: no checkpoint to mount
            assert args.model is None and MODEL_DIR not in mounts, stage
            continue
        assert args.model == MODEL_DIR and mounts[MODEL_DIR].get("readOnly"), stage
        claim = volumes[mounts[MODEL_DIR]["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": "stagediff-models", "readOnly": True}, stage
        if stage in ("dit", "vae"):  # multi-process torch groups
            assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory", stage


@pytest.mark.parametrize(("component", "objects"), WHOLE_CASES, ids=WHOLE_CASE_IDS)
def test_every_container_binds_every_interface_and_starts_under_the_secure_defaults(
    component: str | None, objects: list[dict[str, Any]]
) -> None:
    """Servers bind loopback unless told otherwise, which in a pod reaches nobody; and each command passes the
    startup checks: a stage has the cluster secret, the orchestrator's plaintext port with tenants says
    --insecure (TLS ends in front of it)."""
    for _, _, container, stage, args in _containers(_case_flags(component, objects), objects):
        assert args.host == "0.0.0.0", stage
        if stage == GATEWAY:  # plain HTTP behind the Service, like the orchestrator's port
            assert gateway_refusal(args) is None and args.insecure and args.tls_cert is None
            continue
        has_secret = any(entry["name"] == CLUSTER_SECRET_ENV for entry in container["env"])
        assert startup_refusal(stage, args, has_secret) is None, stage
        if stage == "orchestrator":
            assert args.tenants and args.insecure and args.tls_cert is None


def test_orchestrator_state_tenants_and_metrics() -> None:
    workload, pod, container, _, args = next(c for c in _containers(_flags(), BASE) if c[3] == "orchestrator")
    assert workload["spec"]["replicas"] == 1 and workload["spec"]["strategy"]["type"] == "Recreate"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[args.state_dir]]["persistentVolumeClaim"]["claimName"] == "stagediff-state"
    tenants = Path(args.tenants)
    secret = volumes[mounts[str(tenants.parent)]]["secret"]
    assert secret["secretName"] == "stagediff-tenants"
    assert {"key": "tenants.yaml", "path": tenants.name} in secret["items"]
    assert args.metrics_port == 9090 and 9090 in {p["containerPort"] for p in container["ports"]}
    service = _one(BASE, "Service", "orchestrator")
    assert {p["port"] for p in service["spec"]["ports"]} == {args.port, args.metrics_port}


def _serves(objects: list[dict[str, Any]], host: str, port: int) -> str:
    """The stage behind HOST:PORT: a Service, a pod of a StatefulSet by its headless Service, or (`dns:NAME`)
    every ready pod of a headless Service, looked up again every probe interval."""
    if host.startswith("dns:"):
        service = _one(objects, "Service", host.removeprefix("dns:"))
        assert service["spec"].get("clusterIP") == "None", f"{host}: one address per pod needs a headless Service"
        assert not service["spec"].get("publishNotReadyAddresses"), f"{host}: list only the pods that are ready"
        assert port in {p["port"] for p in service["spec"]["ports"]}, f"{host}:{port}: no such Service port"
        return str(service["spec"]["selector"]["app.kubernetes.io/component"])
    pod_name, _, service_name = host.partition(".")
    service = _one(objects, "Service", service_name or pod_name)
    assert port in {p["port"] for p in service["spec"]["ports"]}, f"{host}:{port}: no such Service port"
    if service_name:
        assert service["spec"].get("clusterIP") == "None", f"{service_name}: per-pod names need a headless Service"
        owners = [w for w in _workloads(objects) if w["spec"].get("serviceName") == service_name]
        assert len(owners) == 1, host
        ordinal = int(pod_name.rpartition("-")[2])
        assert pod_name == f"{owners[0]['metadata']['name']}-{ordinal}" and ordinal < owners[0]["spec"]["replicas"]
    return service["spec"]["selector"]["app.kubernetes.io/component"]


@pytest.mark.parametrize(("component", "objects"), CASES, ids=CASE_IDS)
def test_orchestrator_reaches_every_stage(component: str | None, objects: list[dict[str, Any]]) -> None:
    flags = _flags(component)
    everything = BASE + objects if component else BASE
    if component:  # the component drops the base's single DiT Deployment and Service
        everything = [o for o in everything if not (o["metadata"]["name"] == "dit" and o in BASE)]
    ports = {stage: args.port for _, _, _, stage, args in _containers(flags, everything)}
    orchestrator = next(c[4] for c in _containers(flags, BASE) if c[3] == "orchestrator")
    for stage in STAGES:
        endpoints = getattr(orchestrator, stage.replace("-", "_")).split(",")
        for endpoint in endpoints:
            host, _, port = endpoint.rpartition(":")
            assert int(port) == ports[stage], endpoint
            assert _serves(everything, host, int(port)) == stage, endpoint
    if component == "dit-replicas":  # every ready replica, however many the StatefulSet has
        assert orchestrator.dit == "dns:dit-pods:50062"
    if component == "dit-multinode":
        assert orchestrator.dit == "dit-group-0.dit-group:50062", "a multi-node group is served by its node 0"


def test_the_gateway_is_ready_when_its_orchestrator_answers() -> None:
    """The gateway dials the orchestrator's Service on its public port; kubelet's HTTP probes ask /readyz (200 once the
    orchestrator answers its health check) for readiness and /healthz (the process) for liveness; a Service publishes
    its port."""
    workload, _, container, _, args = next(c for c in _containers(_flags(), BASE) if c[3] == GATEWAY)
    host, _, port = args.orchestrator.rpartition(":")
    orchestrator = next(c[4] for c in _containers(_flags(), BASE) if c[3] == "orchestrator")
    assert int(port) == orchestrator.port and _serves(BASE, host, int(port)) == "orchestrator"
    assert args.orchestrator_ca_cert is None and not args.orchestrator_tls, "the orchestrator's port is plaintext here"
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"http": args.port}
    paths = {probe: container[probe]["httpGet"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths["readinessProbe"] == {"path": "/readyz", "port": "http"}
    assert paths["livenessProbe"] == paths["startupProbe"] == {"path": "/healthz", "port": "http"}
    service = _one(BASE, "Service", "gateway")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(args.port, "http")]
    selector = service["spec"]["selector"]
    assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    assert workload["spec"]["replicas"] >= 2, "no state: more than one, so a restart drops no request"


def test_disruption_budgets_cover_orchestrator_and_dit() -> None:
    for name in ("orchestrator", "dit"):
        budget = _one(BASE, "PodDisruptionBudget", name)
        selector = budget["spec"]["selector"]["matchLabels"]
        groups = _objects(K8S_DIR / "dit-lws")
        pods = [w for w in _workloads(BASE + REPLICAS + MULTINODE + groups) if w["metadata"]["name"].startswith(name)]
        assert pods and all(selector.items() <= pod_template(w)["metadata"]["labels"].items() for w in pods)


def test_a_multinode_group_has_one_pod_per_node_joined_through_pod_0() -> None:
    statefulset = _one(MULTINODE, "StatefulSet", "dit-group")
    nodes = statefulset["spec"]["replicas"]
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    flags = _flags("dit-multinode")
    for index in range(nodes):
        args = parse_serve(command_argv(container, flags, pod_index=index))
        assert (args.node_rank, args.nnodes) == (index, nodes), "pod N of the StatefulSet is node N"
        master_pod, _, service_name = args.master_addr.partition(".")
        assert (master_pod, service_name) == ("dit-group-0", statefulset["spec"]["serviceName"])
    # Every pod reaches node 0's store and control port by name before node 0 is ready.
    headless = _one(MULTINODE, "Service", service_name)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    published = {port["port"] for port in headless["spec"]["ports"]}
    exposed = {port["containerPort"] for port in container["ports"]}
    assert {args.port, args.master_port, args.group_port} <= published & exposed
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel", "the nodes wait for each other: start together"
    anti_affinity = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti_affinity[0]["topologyKey"] == "kubernetes.io/hostname", "one node of the group per machine"


# The two-models component: each model's checkpoint claim and where every container mounts it (its model id).
TWO_MODEL_CLAIMS = {"/models/wan-t2v": "stagediff-models", "/models/wan-i2v": "stagediff-models-i2v"}


def test_two_models_builds_valid_objects() -> None:
    """The base as the component patches it, and the objects the component adds, in strict mode."""
    for obj in TWO_MODELS_BUILT:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")
    names = {(o["kind"], o["metadata"]["name"]) for o in TWO_MODELS_BUILT}
    assert {("Deployment", "dit"), ("Deployment", "dit-i2v"), ("Service", "dit-i2v-pods")} <= names
    assert ("Service", "dit") not in names, "the base DiT is found through its headless Service"
    for claim in TWO_MODEL_CLAIMS.values():
        assert _one(TWO_MODELS_BUILT, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_two_models_share_one_text_encoder_and_one_vae() -> None:
    """One text encoder and one VAE, each loading one model's checkpoint and serving the other's with --also-serve
    (the VAE loads the image-to-video one: only its family encodes input images); a DiT per model."""
    served: dict[str, list[tuple[str | None, list[str]]]] = {}
    for _, _, _, stage, args in _containers(_flags("two-models"), TWO_MODELS_BUILT):
        if stage in STAGE_KINDS:
            served.setdefault(stage, []).append((args.model, list(getattr(args, "also_serve", []))))
    assert served["text-encoder"] == [("/models/wan-t2v", ["/models/wan-i2v"])]
    assert served["vae"] == [("/models/wan-i2v", ["/models/wan-t2v"])]
    assert sorted(served["dit"]) == [("/models/wan-i2v", []), ("/models/wan-t2v", [])], "a DiT per model"
    assert served["interp"] == [(None, [])], "the interpolator serves every model"


def test_two_models_orchestrator_is_given_both_dits_by_their_headless_services() -> None:
    """Every source the orchestrator's --dit names is a headless Service selecting the pods of one DiT workload,
    and together they reach both; the other stages' endpoints are the base's."""
    flags = _flags("two-models")
    orchestrator = next(c[4] for c in _containers(flags, TWO_MODELS_BUILT) if c[3] == "orchestrator")
    dits = {w["metadata"]["name"]: w for w, _, _, stage, _ in _containers(flags, TWO_MODELS_BUILT) if stage == "dit"}
    reached = []
    for source in orchestrator.dit.split(","):
        assert source.startswith("dns:"), f"{source}: every ready pod of a DiT, however many"
        name, _, port = source.removeprefix("dns:").rpartition(":")
        service = _one(TWO_MODELS_BUILT, "Service", name)
        assert service["spec"].get("clusterIP") == "None" and int(port) == 50062, source
        selector = service["spec"]["selector"].items()
        selected = [
            workload["metadata"]["name"]
            for workload in _workloads(TWO_MODELS_BUILT)
            if selector <= workload["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1 and selected[0] in dits, f"{source} selects {selected}"
        reached.extend(selected)
    assert sorted(reached) == sorted(dits) == ["dit", "dit-i2v"]
    for stage in ("text-encoder", "vae", "interp"):
        assert getattr(orchestrator, stage.replace("-", "_")) == getattr(
            next(c[4] for c in _containers(_flags(), BASE) if c[3] == "orchestrator"), stage.replace("-", "_")
        )


def test_two_models_mount_every_checkpoint_a_container_reads_read_only() -> None:
    """Each stage mounts the checkpoints of its --model and --also-serve, read-only, each model's claim at that
    model's path; no container mounts a checkpoint it does not read."""
    for _, pod, container, stage, args in _containers(_flags("two-models"), TWO_MODELS_BUILT):
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        read = [path for path in [getattr(args, "model", None), *getattr(args, "also_serve", [])] if path]
        assert sorted(path for path in mounts if path.startswith("/models/")) == sorted(read), stage
        for path in read:
            assert mounts[path].get("readOnly") is True, f"{stage}: {path} is mounted writable"
            claim = volumes[mounts[path]["name"]]["persistentVolumeClaim"]
            assert claim == {"claimName": TWO_MODEL_CLAIMS[path], "readOnly": True}, f"{stage}: {path}"


# -------------------------------------------------------------------------------------------- custom resources --


def test_custom_resources_embed_valid_kubernetes_types() -> None:
    """KEDA's ScaledObject and LWS's LeaderWorkerSet have no schema here; what they embed does: a ScaledObject's
    scaling behavior is a HorizontalPodAutoscaler's, a LeaderWorkerSet's template a PodTemplate's, both strict."""
    custom = [doc for path in MANIFEST_FILES for doc in load(path) if is_custom(doc)]
    assert {o["kind"] for o in custom} == set(CUSTOM_KINDS)
    for obj in custom:
        name = obj["metadata"]["name"]
        if obj["kind"] == "ScaledObject":
            spec = obj["spec"]
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": name},
                "spec": {
                    "scaleTargetRef": spec["scaleTargetRef"],
                    "minReplicas": max(spec["minReplicaCount"], 1),
                    "maxReplicas": spec["maxReplicaCount"],
                    "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
                },
            }
            _validate(hpa, "ScaledObject's behavior: ")
        else:
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
            _validate(template | {"template": pod_template(obj)}, "LeaderWorkerSet's template: ")


def test_custom_resource_checks_can_fail() -> None:
    """A misspelt field of a ScaledObject's behavior is caught through the HPA it embeds in."""
    behavior = {"scaleDown": {"stabilisationWindowSeconds": 600}}
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 2, "behavior": behavior},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


# ----------------------------------------------------------------------------------------------- autoscaling --

PROMETHEUS_SCRAPE_S = 10  # autoscaling/pools/prometheus.yml's scrape_interval


def _scaled_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "ScaledObject"]


def _target(objects: list[dict[str, Any]], scaled: dict[str, Any]) -> dict[str, Any]:
    ref = scaled["spec"]["scaleTargetRef"]
    found = [
        o
        for o in objects
        if (o["apiVersion"], o["kind"], o["metadata"]["name"]) == (ref["apiVersion"], ref["kind"], ref["name"])
    ]
    assert len(found) == 1, f"ScaledObject/{scaled['metadata']['name']}: no {ref} in the build"
    return found[0]


def _served(objects: list[dict[str, Any]]) -> dict[str, tuple[str, Any, dict[str, Any]]]:
    """Each StageDiff workload's name -> (the stage it serves, its parsed command, its pod spec)."""
    flags = _case_flags(None, objects)
    return {w["metadata"]["name"]: (stage, args, pod) for w, pod, _, stage, args in _containers(flags, objects)}


def _startup_allowance_s(pod: dict[str, Any]) -> int:
    (container,) = pod["containers"]
    probe = container["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


def _model_id(args: Any) -> str:
    """A DiT's model id: its checkpoint directory's name."""
    return Path(args.model).name


@pytest.mark.parametrize("build", AUTOSCALED)
def test_every_stage_pool_has_one_scaled_object_on_a_workload_kustomize_builds(build: str) -> None:
    """A ScaledObject (keda.sh/v1alpha1) per workload of every stage, naming it by apiVersion, kind and name; the
    workload names no replica count, which KEDA owns (applying the manifests again must not reset it)."""
    objects = BUILT[build]
    served = _served(objects)
    scaled_targets = []
    for scaled in _scaled_objects(objects):
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        target = _target(objects, scaled)
        name = target["metadata"]["name"]
        assert name in served and served[name][0] in STAGE_KINDS, f"{name}: not a stage's workload"
        assert "replicas" not in target["spec"], f"{target['kind']}/{name}: KEDA owns its replicas"
        spec = scaled["spec"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] and spec["maxReplicaCount"] >= 1
        assert 0 < spec["pollingInterval"] <= 30, "a job at an idle cluster is seen within seconds"
        scaled_targets.append(name)
    stage_workloads = [name for name, (stage, _, _) in served.items() if stage in STAGE_KINDS]
    assert sorted(scaled_targets) == sorted(stage_workloads), "one ScaledObject per stage pool"


@pytest.mark.parametrize("build", AUTOSCALED)
def test_the_dit_scales_from_zero_on_any_job(build: str) -> None:
    """Every DiT pool starts at zero and wakes on the first job (activationThreshold 0: any value above it); its
    first replica lives long enough to load and report its model, which keeps requests for it accepted at zero."""
    objects = BUILT[build]
    served = _served(objects)
    dits = 0
    for scaled in _scaled_objects(objects):
        stage, _, pod = served[_target(objects, scaled)["metadata"]["name"]]
        if stage != "dit":
            continue
        dits += 1
        spec = scaled["spec"]
        assert spec["minReplicaCount"] == 0, "the DiT's GPUs are free while nothing is asked of it"
        for trigger in spec["triggers"]:
            assert float(trigger["metadata"]["activationThreshold"]) == 0, "any job activates the pool"
        assert spec["initialCooldownPeriod"] >= _startup_allowance_s(pod), "the first replica loads and reports"
    assert dits == len([name for name, (stage, _, _) in served.items() if stage == "dit"]) >= 1


@pytest.mark.parametrize("build", AUTOSCALED)
def test_scaling_down_outlasts_calls_and_drains(build: str) -> None:
    """A replica is removed only after a calm longer than its longest call plus its drain (both --drain-grace),
    one per drain grace, and the last one only after a cooldown above its drain grace. The text encoder and the VAE
    stay up as long as a DiT: a warm DiT never waits for them."""
    objects = BUILT[build]
    served = _served(objects)
    cooldowns: dict[str, list[int]] = {}
    for scaled in _scaled_objects(objects):
        stage, args, _ = served[_target(objects, scaled)["metadata"]["name"]]
        spec = scaled["spec"]
        grace = args.drain_grace
        assert spec["cooldownPeriod"] >= grace, stage
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 2 * grace, f"{stage}: longest call + drain"
        for policy in down["policies"]:
            assert policy["type"] == "Pods" and policy["value"] == 1 and policy["periodSeconds"] >= grace, stage
        cooldowns.setdefault(stage, []).append(spec["cooldownPeriod"])
    for stage in ("text-encoder", "vae"):
        assert min(cooldowns[stage]) >= max(cooldowns["dit"]), stage


def _prometheus_address(objects: list[dict[str, Any]], address: str) -> None:
    """`address` reaches the build's Prometheus Service from another namespace (KEDA's operator runs in its own)."""
    url = urlsplit(address)
    service, namespace, suffix = url.hostname.split(".", 2)  # type: ignore[union-attr]
    assert (url.scheme, namespace, suffix) == ("http", NAMESPACE, "svc"), address
    ports = {p["port"] for p in _one(objects, "Service", service)["spec"]["ports"]}
    assert url.port in ports, address


@pytest.mark.parametrize("build", AUTOSCALED)
def test_triggers_ask_the_builds_prometheus_for_metrics_the_orchestrator_exports(build: str) -> None:
    """Every trigger is a Prometheus query of the Prometheus the build runs; it reads only metrics the code exports
    (tests/helpers/metric_names.py), about its own stage, and, where several DiTs serve different models, about its
    own DiT's model only."""
    objects = BUILT[build]
    served = _served(objects)
    models = {_model_id(args) for stage, args, _ in served.values() if stage == "dit"}
    for scaled in _scaled_objects(objects):
        name = scaled["metadata"]["name"]
        stage, args, _ = served[_target(objects, scaled)["metadata"]["name"]]
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
            metadata = trigger["metadata"]
            _prometheus_address(objects, metadata["serverAddress"])
            assert float(metadata["threshold"]) > 0, name
            query = metadata["query"]
            assert not unknown_metrics([query]), f"ScaledObject/{name}: {unknown_metrics([query])} are not exported"
            assert metrics_read(query) and f'stage="{stage}"' in query, f"ScaledObject/{name}: not about {stage}"
            if stage == "dit" and len(models) > 1:
                named = set(re.findall(r'model="([^"]+)"', query))
                assert named == {_model_id(args)}, f"ScaledObject/{name}: its DiT serves {_model_id(args)}"


def test_the_metric_check_of_a_trigger_can_fail() -> None:
    query = 'sum(stagediff_pool_calls_waiting{stage="dit"}) + sum(stagediff_dit_jobs_pending)'
    assert unknown_metrics([query]) == ["stagediff_dit_jobs_pending"]


@pytest.mark.parametrize("build", AUTOSCALED)
def test_prometheus_scrapes_every_orchestrator_on_its_metrics_port(build: str) -> None:
    """The Prometheus the triggers ask reads its scrape configuration from the generated ConfigMap and finds every
    orchestrator pod by DNS: a headless Service selecting the orchestrator's pods, listing them before they are
    ready, on the port the orchestrator serves /metrics on."""
    objects = BUILT[build]
    prometheus = _one(objects, "Deployment", "prometheus")
    pod = prometheus["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_flag = next(arg for arg in container["args"] if arg.startswith("--config.file="))
    config_path = Path(config_flag.partition("=")[2])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = _one(objects, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_path.name])
    assert config["global"]["scrape_interval"] == f"{PROMETHEUS_SCRAPE_S}s"
    orchestrator = next(c for c in _containers(_case_flags(None, objects), objects) if c[3] == "orchestrator")
    labels = orchestrator[0]["spec"]["template"]["metadata"]["labels"]
    (job,) = config["scrape_configs"]
    (discovery,) = job["dns_sd_configs"]
    assert discovery["type"] == "A" and discovery["port"] == orchestrator[4].metrics_port
    for name in discovery["names"]:
        service = _one(objects, "Service", name)["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True, name
        assert service["selector"].items() <= labels.items(), f"{name} does not select the orchestrator's pods"
        assert orchestrator[4].metrics_port in {p["port"] for p in service["ports"]}


@pytest.mark.parametrize("build", AUTOSCALED)
def test_the_orchestrator_waits_for_a_pool_at_zero_to_start(build: str) -> None:
    """--cold-start-timeout (STAGEDIFF_COLD_START_TIMEOUT from the ConfigMap) covers KEDA noticing the job and the
    slowest pool's model load: a job at an idle cluster waits for the DiT rather than failing."""
    objects = BUILT[build]
    served = _served(objects)
    (orchestrator,) = [args for stage, args, _ in served.values() if stage == "orchestrator"]
    needed = 0
    for scaled in _scaled_objects(objects):
        stage, _, pod = served[_target(objects, scaled)["metadata"]["name"]]
        if scaled["spec"]["minReplicaCount"] == 0:
            needed = max(needed, scaled["spec"]["pollingInterval"] + PROMETHEUS_SCRAPE_S + _startup_allowance_s(pod))
    assert needed and orchestrator.cold_start_timeout >= needed


@pytest.mark.parametrize("build", AUTOSCALED)
def test_the_orchestrator_dials_every_ready_pod_of_each_scaled_pool(build: str) -> None:
    """Each stage's endpoints are headless Services (dns:NAME:PORT, looked up every probe interval) that select the
    pods of the workloads the ScaledObjects scale, ready ones only: a pod KEDA adds takes calls once it serves."""
    objects = BUILT[build]
    served = _served(objects)
    (orchestrator,) = [args for stage, args, _ in served.values() if stage == "orchestrator"]
    scaled = {_target(objects, s)["metadata"]["name"] for s in _scaled_objects(objects)}
    for stage in STAGES:
        reached = set()
        for source in getattr(orchestrator, stage.replace("-", "_")).split(","):
            assert source.startswith("dns:"), f"{stage}: {source} is one address, however many pods KEDA runs"
            name, _, port = source.removeprefix("dns:").rpartition(":")
            service = _one(objects, "Service", name)["spec"]
            assert service["clusterIP"] == "None" and not service.get("publishNotReadyAddresses"), source
            assert int(port) in {p["port"] for p in service["ports"]}, source
            reached |= {w["metadata"]["name"] for w in _workloads(objects) if _selects(service["selector"], w)}
        assert reached and reached <= scaled, f"{stage}: {sorted(reached)}"
        assert {served[name][0] for name in reached} == {stage}
        assert all(int(port) == served[name][1].port for name in reached), stage


def _selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    """Whether a Service's selector selects pods of `workload`: its template's labels, and for a LeaderWorkerSet the
    labels LWS adds to each pod (its name, and the worker index: 0 is each group's leader)."""
    labels = dict(pod_template(workload)["metadata"]["labels"])
    if workload["kind"] == "LeaderWorkerSet":
        labels[f"{LWS_LABELS}/name"] = workload["metadata"]["name"]
        index = selector.get(f"{LWS_LABELS}/worker-index")
        if index is not None and 0 <= int(index) < workload["spec"]["leaderWorkerTemplate"]["size"]:
            labels[f"{LWS_LABELS}/worker-index"] = index
    return selector.items() <= labels.items()


# --------------------------------------------------------------------------------------------------- dit-lws --

LWS_LABELS = "leaderworkerset.sigs.k8s.io"
LWS_VARIABLES = ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")


def test_a_leaderworkerset_group_is_a_multinode_dit_joined_through_its_leader() -> None:
    """Each pod of a group runs `serve dit --nnodes $(LWS_GROUP_SIZE) --node-rank $(LWS_WORKER_INDEX) --master-addr
    $(LWS_LEADER_ADDRESS)`, which kubelet expands from what LWS sets: pod N of a group is node N and every pod joins
    the leader's store; the whole group restarts together; the layout spans the group's GPUs."""
    objects = BUILT["dit-lws"]
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == CUSTOM_KINDS["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    assert size >= 2, "a group spans several nodes"
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart", "a lost rank takes the group's collectives down"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated", "the leader is ready only once the workers have joined"
    pod = pod_template(lws)["spec"]
    (container,) = pod["containers"]
    (script,) = container["args"]
    assert all(f"$({name})" in script for name in LWS_VARIABLES), script
    assert not {e["name"] for e in container["env"]} & set(LWS_VARIABLES), "LWS sets them"
    flags = _case_flags(None, objects)
    for group in range(2):
        for index in range(size):
            env = lws_env(lws, worker_index=index, group=group)
            args = _parse(command_argv(container, flags, kubelet_env=env), _env_values(container, flags))
            assert (args.nnodes, args.node_rank) == (size, index)
            assert args.master_addr == env["LWS_LEADER_ADDRESS"] == f"dit-group-{group}.dit-group.{NAMESPACE}"
            assert _gpus(container) * args.nnodes == dit_world_size(args)
    exposed = {port["containerPort"] for port in container["ports"]}
    assert {args.port, args.master_port, args.group_port} <= exposed
    anti_affinity = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti_affinity[0]["topologyKey"] == "kubernetes.io/hostname", "one pod of a group per machine"


def test_the_orchestrator_reaches_each_groups_leader_by_a_headless_service() -> None:
    """--dit dns:dit-leaders:50062: a headless Service of the ready leaders (worker index 0, which serves the stage),
    never the workers; not named as the set, whose own headless Service LWS makes for the rendezvous."""
    objects = BUILT["dit-lws"]
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    served = _served(objects)
    (orchestrator,) = [args for stage, args, _ in served.values() if stage == "orchestrator"]
    assert orchestrator.dit == "dns:dit-leaders:50062"
    name, _, port = orchestrator.dit.removeprefix("dns:").rpartition(":")
    assert name != lws["metadata"]["name"]
    service = _one(objects, "Service", name)["spec"]
    assert service["clusterIP"] == "None" and not service.get("publishNotReadyAddresses")
    assert service["selector"] == {f"{LWS_LABELS}/name": lws["metadata"]["name"], f"{LWS_LABELS}/worker-index": "0"}
    assert int(port) == served[lws["metadata"]["name"]][1].port
    assert _selects(service["selector"], lws)
    assert ("Deployment", "dit") not in {(o["kind"], o["metadata"]["name"]) for o in objects}, "the groups replace it"
