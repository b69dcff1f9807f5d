"""The compose topology and how `stagediff up` turns it into local commands.

No processes are started, except by the one end-to-end test at the end: `stagediff up` serving an image model,
whose chain has no interpolator.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.auth import CLUSTER_SECRET_ENV
from services.stage_table import STAGES as STAGE_KINDS
from stagediff import Client
from stagediff.local import up
from stagediff.local.compose import DEFAULT_COMPOSE_FILE, interpolate, load_compose, read_env_file
from stagediff.local.launch import free_ports
from stagediff.local.supervisor import LocalCluster, is_http_ready, wait_for_http_ready, wait_for_serving
from tests.test_secure_defaults import parse_serve, startup_refusal

REPOSITORY = Path(__file__).resolve().parent.parent
DEPLOY = REPOSITORY / "deploy"
GPU_COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CPU_COMPOSE_FILE = DEPLOY / "docker-compose.cpu.yml"
SINGLE_GPU_COMPOSE_FILE = DEPLOY / "docker-compose.single-gpu.yml"
STAGE_TLS_OVERRIDE = DEPLOY / "docker-compose.stage-tls.yml"
IMAGE_OVERRIDE = DEPLOY / "docker-compose.image.yml"
COMMON_SERVICES = DEPLOY / "common-services.yml"
VARIANTS = [GPU_COMPOSE_FILE, SINGLE_GPU_COMPOSE_FILE, CPU_COMPOSE_FILE]
STAGES = {"text-encoder": 50061, "dit": 50062, "vae": 50063, "interp": 50064}
# The stages every chain needs; the interpolator is optional (families/).
REQUIRED_STAGES = ("text-encoder", "dit", "vae")
# The HTTP gateway (`stagediff serve http`): a client of the orchestrator's public port, published beside it.
GATEWAY = "gateway"
GATEWAY_PORT = 8000
LOCAL_PORTS = {
    "text-encoder": 41001, "dit": 41002, "vae": 41003, "interp": 41004, "orchestrator": 41000, GATEWAY: 41008
}  # fmt: skip


def _checkpoint(directory: Path, pipeline: str = "WanPipeline") -> Path:
    """A directory `stagediff up` takes for a checkpoint of `pipeline`: its model_index.json names the family."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return directory


def test_default_compose_file_is_the_cpu_variant() -> None:
    assert DEFAULT_COMPOSE_FILE.resolve() == CPU_COMPOSE_FILE


def test_the_wheel_names_every_package_and_ships_the_compose_files() -> None:
    """pyproject.toml lists the packages by name, so that deploy/ ships as the package `stagediff.deploy`
    (`stagediff up` from an installed wheel): the list names every package of the tree, and the package
    data every compose and env file."""
    setuptools = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {
        ".".join(init.parent.relative_to(REPOSITORY).parts)
        for top in REPOSITORY.iterdir()
        if (top / "__init__.py").is_file() and top.name != "tests"
        for init in top.rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted([*tree, "stagediff.deploy"])
    assert setuptools["package-dir"] == {"stagediff.deploy": "deploy"}
    shipped = {path for pattern in setuptools["package-data"]["stagediff.deploy"] for path in DEPLOY.glob(pattern)}
    assert shipped == {*DEPLOY.glob("*.yml"), *DEPLOY.glob("env/*.env")}


# -- the topology itself, as docker-compose resolves it -----------------------


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail("docker-compose is not on PATH: install Debian's package (apt-get install -y docker-compose)")
    return path


def _config(*files: Path, quiet: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    arguments = [argument for file in files for argument in ("-f", str(file))]
    return subprocess.run(
        [_docker_compose(), *arguments, "config", *(["-q"] if quiet else [])],
        capture_output=True,
        text=True,
        cwd=DEPLOY.parent,
        env={**os.environ, **(env or {})},
    )


@functools.cache
def _resolved(*files: Path) -> dict[str, Any]:
    """The services of `files` after docker-compose's own `extends`, env files, overrides and interpolation
    (read once; callers must not change what it returns)."""
    result = _config(*files)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@pytest.mark.parametrize(
    "files",
    [*((file,) for file in [*VARIANTS, COMMON_SERVICES]), *((file, IMAGE_OVERRIDE) for file in VARIANTS)],
    ids=lambda files: "+".join(file.name for file in files),
)
def test_docker_compose_config_accepts_every_file(files: tuple[Path, ...]) -> None:
    result = _config(*files, quiet=True)
    assert result.returncode == 0, result.stderr


def test_every_stage_reserves_its_gpus_and_has_a_health_check() -> None:
    services = _resolved(GPU_COMPOSE_FILE)
    assert set(services) == {*STAGES, "orchestrator", GATEWAY}
    gpus_of = {}
    for name, port in STAGES.items():
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert all(d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] for d in devices), name
        gpus_of[name] = [gpu for device in devices for gpu in device["device_ids"]]
        assert gpus_of[name], f"{name} reserves no GPU"
        health = services[name]["healthcheck"]
        assert health["test"] == ["CMD", "stagediff", "health", "--endpoint", f"localhost:{port}"]
        assert health["start_period"] == "10m", "model loading takes minutes before the stage serves"
        model_volumes = [v for v in services[name].get("volumes", []) if v.endswith(":/models/model:ro")]
        # The model is mounted read-only where it is read; the interpolator reads no checkpoint.
        assert len(model_volumes) == int(STAGE_KINDS[name].reads_checkpoint), name
        assert services[name]["secrets"] == [{"source": "cluster_secret"}]
        assert services[name]["environment"]["STAGEDIFF_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret"
    assert sorted(gpu for gpus in gpus_of.values() for gpu in gpus) == [str(g) for g in range(8)], (
        "the 8-GPU example gives each GPU to one stage"
    )
    # The groups' parallel flags come from their env files and match the GPUs they reserve.
    assert len(gpus_of["dit"]) == 4 and services["dit"]["environment"]["STAGEDIFF_ULYSSES_DEGREE"] == "4"
    assert len(gpus_of["vae"]) == 2 and services["vae"]["environment"]["STAGEDIFF_VAE_PATCH_PARALLEL_SIZE"] == "2"
    for name in ("dit", "vae"):
        assert services[name]["shm_size"], f"{name}: torch.distributed ranks need a large /dev/shm"


def test_the_depends_on_chain_ends_at_the_orchestrator() -> None:
    """The orchestrator starts once every stage a chain needs is healthy; not after the optional interpolator,
    which the image override leaves out (an override cannot take a dependency away)."""
    for file in VARIANTS:
        services = _resolved(file)
        orchestrator = services["orchestrator"]
        expected = {name: {"condition": "service_healthy"} for name in REQUIRED_STAGES}
        assert orchestrator["depends_on"] == expected, file.name
        assert all(not services[name].get("depends_on") for name in STAGES), "stages start independently"
        assert orchestrator["healthcheck"]["test"][-1] == "localhost:50051"
        assert [target for _, target in _published(orchestrator)] == ["50051"]
        for name, port in STAGES.items():
            assert f"{name}:{port}" in orchestrator["command"]
        assert services[GATEWAY]["depends_on"] == {"orchestrator": {"condition": "service_healthy"}}, file.name


@pytest.mark.parametrize("file", VARIANTS, ids=lambda f: f.name)
def test_the_http_gateway_calls_the_orchestrator_and_is_ready_once_its_readyz_answers(file: Path) -> None:
    """`serve http` on 8000, in front of the orchestrator's public port; its health check is GET /readyz (200 once
    the orchestrator answers its own health check), by Python's urllib: the image has no curl."""
    gateway = _resolved(file)[GATEWAY]
    assert gateway["command"] == [
        "serve", "http", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--orchestrator", "orchestrator:50051"
    ]  # fmt: skip
    test = gateway["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and f"://localhost:{GATEWAY_PORT}/readyz" in test[3]
    assert "deploy" not in gateway, "the gateway reserves no GPU"
    assert not gateway.get("volumes"), "the gateway reads no checkpoint and keeps no state"
    assert "STAGEDIFF_CLUSTER_SECRET_FILE" not in gateway["environment"], "it calls the public port, as a client"
    assert not {"cluster_secret", "tenants"} & {s["source"] for s in gateway.get("secrets", [])}
    assert f"EXPOSE {GATEWAY_PORT} " in (DEPLOY / "Dockerfile").read_text()


@pytest.mark.parametrize("reply", [200, 503, None], ids=["ready", "not-ready", "closed"])
def test_the_gateway_health_check_command_passes_on_200_only(reply: int | None) -> None:
    """The compose health check itself, run against a stand-in for the gateway (on a free port rather than 8000,
    which something else on this machine may hold)."""
    (script,) = _resolved(CPU_COMPOSE_FILE)[GATEWAY]["healthcheck"]["test"][3:]
    assert f"localhost:{GATEWAY_PORT}/" in script
    with _readyz_server(reply) as port:
        local = script.replace(f"localhost:{GATEWAY_PORT}/", f"localhost:{port}/")
        result = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=30)
    assert (result.returncode == 0) == (reply == 200), result.stderr


@pytest.mark.parametrize("file", VARIANTS, ids=lambda f: f.name)
def test_stagediff_up_reads_a_file_as_docker_compose_does(file: Path) -> None:
    resolved = _resolved(file)
    services = load_compose(file, {})
    assert list(services) == [*STAGES, "orchestrator", GATEWAY]
    assert [name for name, service in services.items() if service.is_http] == [GATEWAY]
    assert services[GATEWAY].stage_kind is None and services[GATEWAY].container_port == GATEWAY_PORT
    for name, service in services.items():
        expected = resolved[name]
        assert service.command == expected["command"], name
        assert service.environment == {key: str(value) for key, value in expected["environment"].items()}, name
        devices = ((expected.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices", [])
        assert service.gpu_device_ids == [gpu for device in devices for gpu in device["device_ids"]], name
        assert set(service.depends_on) == set(expected.get("depends_on") or {}), name
        assert [secret for secret, _ in service.secret_files] == [s["source"] for s in expected.get("secrets", [])]


def _published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, container port) of each port a service publishes, in either form docker-compose prints."""
    published = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):  # {published, target[, host_ip]}
            published.append((entry.get("host_ip", "0.0.0.0"), str(entry["target"])))
        else:  # "[HOST_IP:]PUBLISHED:TARGET[/PROTOCOL]"
            fields = entry.split("/")[0].split(":")
            published.append((fields[0] if len(fields) == 3 else "0.0.0.0", fields[-1]))
    return published


@pytest.mark.parametrize("file", VARIANTS, ids=lambda f: f.name)
def test_only_the_public_ports_are_published_and_only_on_loopback_by_default(file: Path) -> None:
    """The orchestrator's gRPC port and the HTTP gateway's; never a stage's."""
    services = _resolved(file)
    for name in STAGES:
        assert not services[name].get("ports"), f"{name}: a stage port is published"
        assert not services[name].get("expose"), name
    assert _published(services["orchestrator"]) == [("127.0.0.1", "50051")]
    assert _published(services[GATEWAY]) == [("127.0.0.1", str(GATEWAY_PORT))]
    result = _config(file, env={"STAGEDIFF_HTTP_PUBLISHED_PORT": "18000"})
    assert result.returncode == 0, result.stderr
    assert "18000:8000" in yaml.safe_dump(yaml.safe_load(result.stdout)["services"][GATEWAY]["ports"])


def test_the_open_tenant_is_never_published_beyond_loopback() -> None:
    """The CPU and single-GPU files serve the open tenant: their address is not a variable."""
    for file in (CPU_COMPOSE_FILE, SINGLE_GPU_COMPOSE_FILE):
        orchestrator = _resolved(file)["orchestrator"]
        assert "--tenants" not in orchestrator["command"] and "STAGEDIFF_TENANTS" not in orchestrator["environment"]
        result = _config(file, env={"STAGEDIFF_PUBLISHED_ADDRESS": "0.0.0.0", "STAGEDIFF_PUBLISHED_PORT": "6000"})
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        assert _published(services["orchestrator"]) == [("127.0.0.1", "50051")], file.name
        assert _published(services[GATEWAY]) == [("127.0.0.1", str(GATEWAY_PORT))], file.name
    # The GPU file, with tenants, opens its plaintext ports beyond loopback only when told to, both at once.
    result = _config(GPU_COMPOSE_FILE, env={"STAGEDIFF_PUBLISHED_ADDRESS": "0.0.0.0"})
    services = yaml.safe_load(result.stdout)["services"]
    assert _published(services["orchestrator"]) == [("0.0.0.0", "50051")]
    assert _published(services[GATEWAY]) == [("0.0.0.0", str(GATEWAY_PORT))]


def gateway_refusal(args: Any) -> str | None:
    """What `stagediff serve http` refuses to start for (its own check): plain HTTP beyond loopback, where Bearer
    keys would cross the network in clear, unless told --insecure; a TLS certificate without its key."""
    from services.gateway.service import startup_problem

    return startup_problem(args)


def _starts(services: dict[str, Any]) -> dict[str, str | None]:
    """For each service: why its command and environment would refuse to start, or None; parsed by the real
    parser of the service it starts, with its STAGEDIFF_* environment."""
    reasons = {}
    for name, service in services.items():
        environment = {key: str(value) for key, value in (service.get("environment") or {}).items()}
        with pytest.MonkeyPatch.context() as patch:
            for key in [key for key in os.environ if key.startswith("STAGEDIFF_") and key != CLUSTER_SECRET_ENV]:
                patch.delenv(key)
            for key, value in environment.items():
                patch.setenv(key, value)
            args = parse_serve(service["command"][1:])
        assert args.host == "0.0.0.0", f"{name}: a container must bind every interface to be reached"
        if service["command"][1] == "http":  # a client of the public port: no cluster secret
            reasons[name] = gateway_refusal(args)
            continue
        has_secret = args.cluster_secret_file is not None
        reasons[name] = startup_refusal(service["command"][1], args, has_secret)
    return reasons


@pytest.mark.parametrize(
    "files",
    [(CPU_COMPOSE_FILE,), (SINGLE_GPU_COMPOSE_FILE,), (GPU_COMPOSE_FILE,), (GPU_COMPOSE_FILE, STAGE_TLS_OVERRIDE)],
    ids=["cpu", "single-gpu", "gpu", "gpu+stage-tls"],
)
def test_every_service_starts_under_the_secure_defaults(files: tuple[Path, ...]) -> None:
    assert _starts(_resolved(*files)) == {name: None for name in [*STAGES, "orchestrator", GATEWAY]}


def test_the_secure_defaults_can_refuse_a_compose_file() -> None:
    """The same check, without the `--insecure` of env/no-secrets.env, finds what would not start."""
    services = {
        name: {**service, "environment": {k: v for k, v in service["environment"].items() if k != "STAGEDIFF_INSECURE"}}
        for name, service in _resolved(CPU_COMPOSE_FILE).items()
    }
    reasons = _starts(services)
    assert all("no cluster secret" in (reasons[name] or "") for name in [*STAGES, "orchestrator"]), reasons
    assert "API keys in clear" in (reasons[GATEWAY] or ""), reasons


def test_the_gateway_serves_https_with_the_orchestrators_certificate_once_told_to() -> None:
    """env/gateway.env's TLS lines, uncommented, give the gateway the orchestrator's tls_cert and tls_key secrets;
    the secure defaults then hold without --insecure."""
    environment = read_env_file(DEPLOY / "env" / "gateway.env")
    assert environment["STAGEDIFF_INSECURE"] == "true"
    commented = (DEPLOY / "env" / "gateway.env").read_text()
    for line in ("# STAGEDIFF_TLS_CERT=/run/secrets/tls_cert", "# STAGEDIFF_TLS_KEY=/run/secrets/tls_key"):
        assert line in commented and line in (DEPLOY / "env" / "orchestrator.env").read_text(), line
    tls = {"STAGEDIFF_TLS_CERT": "/run/secrets/tls_cert", "STAGEDIFF_TLS_KEY": "/run/secrets/tls_key"}
    gateway = _resolved(GPU_COMPOSE_FILE)[GATEWAY]
    with pytest.MonkeyPatch.context() as patch:
        for key in [key for key in os.environ if key.startswith("STAGEDIFF_")]:
            patch.delenv(key)
        for key, value in tls.items():
            patch.setenv(key, value)
        args = parse_serve(gateway["command"][1:])
    assert (args.tls_cert, args.tls_key, args.insecure) == (tls["STAGEDIFF_TLS_CERT"], tls["STAGEDIFF_TLS_KEY"], False)
    assert gateway_refusal(args) is None


def test_the_stage_tls_override_turns_tls_on_for_every_stage_channel_and_health_check() -> None:
    services = _resolved(GPU_COMPOSE_FILE, STAGE_TLS_OVERRIDE)
    orchestrator = services["orchestrator"]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in orchestrator["environment"].items():
            patch.setenv(key, str(value))
        ca = parse_serve(orchestrator["command"][1:]).stage_tls_ca
    assert ca == "/run/secrets/stage_tls_ca" and {"source": "stage_tls_ca"} in orchestrator["secrets"]
    assert _published(orchestrator) == [("127.0.0.1", "50051")]
    for name, port in STAGES.items():
        environment = services[name]["environment"]
        assert environment["STAGEDIFF_TLS_CERT"] == "/run/secrets/stage_tls_cert", name
        assert environment["STAGEDIFF_TLS_KEY"] == "/run/secrets/stage_tls_key", name
        assert {s["source"] for s in services[name]["secrets"]} >= {"cluster_secret", "stage_tls_cert", "stage_tls_key"}
        health = services[name]["healthcheck"]["test"]
        assert health == ["CMD", "stagediff", "health", "--endpoint", f"localhost:{port}", "--ca-cert", ca], name


def test_the_single_gpu_variant_puts_every_stage_on_gpu_0() -> None:
    single, gpu = _resolved(SINGLE_GPU_COMPOSE_FILE), _resolved(GPU_COMPOSE_FILE)
    for name in STAGES:
        (device,) = single[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}, name
        assert not any(key.endswith("_DEGREE") or "PARALLEL" in key for key in single[name]["environment"]), name
        assert single[name]["command"] == gpu[name]["command"]
    assert single["dit"]["image"] == gpu["dit"]["image"] == "stagediff:cuda"


def test_gpu_reservations_become_cuda_visible_devices_and_secrets_host_paths(tmp_path: Path) -> None:
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "cluster_secret").write_text("s3cret-from-the-file\n")
    (secrets_dir / "tenants.yaml").write_text("tenants: []\n")
    cluster = LocalCluster(
        _checkpoint(tmp_path), compose_file=GPU_COMPOSE_FILE, env={"STAGEDIFF_SECRETS_DIR": str(secrets_dir)}
    )
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    visible = {name: plans[name].environment.get("CUDA_VISIBLE_DEVICES") for name in plans}
    assert visible == {
        "text-encoder": "6", "dit": "0,1,2,3", "vae": "4,5", "interp": "7", "orchestrator": None, GATEWAY: None
    }  # fmt: skip
    for name, plan in plans.items():
        if name == GATEWAY:  # a client of the orchestrator's public port: no secret file of its own
            assert "STAGEDIFF_CLUSTER_SECRET_FILE" not in plan.environment
            continue
        assert plan.environment["STAGEDIFF_CLUSTER_SECRET_FILE"] == str(secrets_dir / "cluster_secret")
    assert plans["orchestrator"].environment["STAGEDIFF_TENANTS"] == str(secrets_dir / "tenants.yaml")
    assert plans["dit"].environment["STAGEDIFF_ULYSSES_DEGREE"] == "4"
    assert cluster.cluster_secret == "s3cret-from-the-file", "the cluster's own calls carry the file's secret"


def test_a_missing_secret_file_is_refused_naming_it(tmp_path: Path) -> None:
    cluster = LocalCluster(
        _checkpoint(tmp_path), compose_file=GPU_COMPOSE_FILE, env={"STAGEDIFF_SECRETS_DIR": str(tmp_path)}
    )
    with pytest.raises(ValueError, match=r"secret 'cluster_secret' reads .*cluster_secret, which does not exist"):
        cluster.plan(local_ports=LOCAL_PORTS)


# -- rewriting commands for local processes ----------------------------------


def test_commands_get_local_ports_hosts_references_and_model_path(tmp_path: Path) -> None:
    cluster = LocalCluster(_checkpoint(tmp_path), port=0)
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    assert list(plans) == [*STAGES, "orchestrator", GATEWAY], "stages first, then the orchestrator, then the gateway"
    model = str(tmp_path.resolve())
    for name in STAGES:
        checkpoint = ["--model", model] if STAGE_KINDS[name].reads_checkpoint else []
        assert plans[name].args == [
            "serve", name, *checkpoint, "--host", "127.0.0.1", "--port", str(LOCAL_PORTS[name])
        ]  # fmt: skip
        assert plans[name].endpoint == f"127.0.0.1:{LOCAL_PORTS[name]}"
        assert plans[name].waits_for == []
        assert plans[name].environment["PYTHONUNBUFFERED"] == "1"
    orchestrator = plans["orchestrator"]
    assert orchestrator.args == [
        "serve", "orchestrator", "--host", "127.0.0.1", "--port", "41000",
        "--text-encoder", "127.0.0.1:41001", "--dit", "127.0.0.1:41002",
        "--vae", "127.0.0.1:41003", "--interp", "127.0.0.1:41004",
        "--state-dir", "/var/lib/stagediff", "--metrics-port", "0",
        "--state-dir", str(cluster.state_dir),
    ]  # fmt: skip
    assert orchestrator.waits_for == list(REQUIRED_STAGES), "the compose file's depends_on: service_healthy"
    assert all(plans[name].ready_url is None for name in [*STAGES, "orchestrator"]), "gRPC health"
    # The HTTP gateway dials the orchestrator's local port, starts once it serves, and is ready when its /readyz is.
    gateway = plans[GATEWAY]
    assert gateway.args == [
        "serve", "http", "--host", "127.0.0.1", "--port", "41008", "--orchestrator", "127.0.0.1:41000"
    ]  # fmt: skip
    assert gateway.waits_for == ["orchestrator"]
    assert gateway.endpoint == "127.0.0.1:41008" and gateway.ready_url == "http://127.0.0.1:41008/readyz"
    # Every process gets the cluster's secret: stages refuse to start without one, and need no --insecure.
    assert {plan.environment[CLUSTER_SECRET_ENV] for plan in plans.values()} == {cluster.cluster_secret}


def test_free_ports_are_distinct_and_the_orchestrator_takes_the_requested_one(tmp_path: Path) -> None:
    free = LocalCluster(_checkpoint(tmp_path), port=0).plan()
    ports = [plan.port for plan in free.values()]
    assert len(set(ports)) == len(ports) and all(port > 0 for port in ports)
    fixed = LocalCluster(tmp_path, port=43210, http_port=43211).plan()
    assert fixed["orchestrator"].port == 43210
    assert fixed["orchestrator"].args[fixed["orchestrator"].args.index("--port") + 1] == "43210"
    assert fixed[GATEWAY].port == 43211 and fixed[GATEWAY].args[fixed[GATEWAY].args.index("--port") + 1] == "43211"
    assert fixed[GATEWAY].args[-1] == "127.0.0.1:43210", "the gateway dials the orchestrator's port"
    assert {43210, 43211}.isdisjoint(plan.port for name, plan in fixed.items() if name not in ("orchestrator", GATEWAY))


def test_a_wildcard_host_is_bound_but_reached_through_loopback(tmp_path: Path) -> None:
    plans = LocalCluster(_checkpoint(tmp_path), host="0.0.0.0").plan(local_ports=LOCAL_PORTS)
    assert plans["dit"].args[plans["dit"].args.index("--host") + 1] == "0.0.0.0"
    assert plans["dit"].endpoint == "127.0.0.1:41002"
    assert "127.0.0.1:41002" in plans["orchestrator"].args
    assert plans[GATEWAY].args[plans[GATEWAY].args.index("--host") + 1] == "0.0.0.0"
    assert plans[GATEWAY].args[-1] == "127.0.0.1:41000" and plans[GATEWAY].ready_url == "http://127.0.0.1:41008/readyz"


def test_threads_and_extra_args_go_to_the_stages_they_concern(tmp_path: Path) -> None:
    extra_args = {"dit": ["--ulysses-degree", "2"], "vae": ["--vae-patch-parallel-size", "2"]}
    cluster = LocalCluster(_checkpoint(tmp_path), threads_per_stage=2, extra_args=extra_args)
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    assert plans["dit"].args[-4:] == ["--threads", "2", "--ulysses-degree", "2"]
    assert plans["vae"].args[-4:] == ["--threads", "2", "--vae-patch-parallel-size", "2"]
    assert plans["text-encoder"].args[-2:] == ["--threads", "2"]
    assert "--threads" not in plans["orchestrator"].args
    assert "--threads" not in plans[GATEWAY].args, "the gateway has no torch threads to set"
    with pytest.raises(ValueError, match="options for ditt, which this cluster does not run"):
        LocalCluster(tmp_path, extra_args={"ditt": ["--usp", "2"]})


def test_up_routes_stage_flags_to_their_stage() -> None:
    args = up.build_parser().parse_args(
        ["--model", "m", "--embedding-cache-size", "16", "--usp", "2", "--use-hsdp", "--vae-use-tiling"]
    )
    assert args.port == 50051 and args.file == str(DEFAULT_COMPOSE_FILE) and args.host == "127.0.0.1"
    assert args.http_port == GATEWAY_PORT
    assert up.stage_flags(args) == {
        "text-encoder": ["--embedding-cache-size", "16"],
        "dit": ["--ulysses-degree", "2", "--use-hsdp"],
        "vae": ["--vae-use-tiling"],
    }


def test_up_passes_each_value_of_a_repeated_flag_after_its_own_flag() -> None:
    args = up.build_parser().parse_args(["--model", "m", "--lora-dir", "d", "--lora", "a", "--lora", "b:0.5"])
    assert up.stage_flags(args) == {"dit": ["--lora-dir", "d", "--lora", "a", "--lora", "b:0.5"]}


def test_an_image_model_runs_without_the_interpolator(tmp_path: Path) -> None:
    """qwen-image's chain is text-encoder -> dit -> vae: the file's interp service does not start, and the
    orchestrator is given no --interp endpoint and waits for no interpolator."""
    qwen = LocalCluster(_checkpoint(tmp_path / "qwen", "QwenImagePipeline"))
    plans = qwen.plan(local_ports=LOCAL_PORTS)
    assert list(plans) == [*REQUIRED_STAGES, "orchestrator", GATEWAY], "the gateway runs no stage: always kept"
    orchestrator = plans["orchestrator"]
    assert "--interp" not in orchestrator.args and orchestrator.waits_for == list(REQUIRED_STAGES)
    assert orchestrator.args[orchestrator.args.index("--vae") + 1] == "127.0.0.1:41003"
    with pytest.raises(ValueError, match=r"options for interp, which this cluster does not run"):
        LocalCluster(qwen.model_dir, extra_args=up.stage_flags(up.build_parser().parse_args(
            ["--model", "m", "--interp-model-path", "rife.pkl"]
        )))  # fmt: skip
    # Wan's chain ends in the optional interpolator: it runs when the file has it, and only then.
    wan = LocalCluster(_checkpoint(tmp_path / "wan")).plan(local_ports=LOCAL_PORTS)
    assert list(wan) == [*STAGES, "orchestrator", GATEWAY]
    compose = _write(
        tmp_path / "no-interp.yml",
        """
        services:
          dit: {command: ["serve", "dit", "--model", "/m", "--port", "7002"]}
          vae: {command: ["serve", "vae", "--model", "/m", "--port", "7003"]}
          text-encoder: {command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]}
          orchestrator:
            command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:7002", "--vae", "vae:7003",
                      "--text-encoder", "text-encoder:7001"]
        """,
    )
    assert list(LocalCluster(tmp_path / "wan", compose_file=compose).plan()) == [
        "dit", "vae", "text-encoder", "orchestrator"
    ]  # fmt: skip


def test_a_chain_the_compose_file_cannot_run_and_a_directory_that_is_no_checkpoint_are_refused(tmp_path: Path) -> None:
    compose = _write(
        tmp_path / "no-vae.yml",
        """
        services:
          dit: {command: ["serve", "dit", "--model", "/m", "--port", "7002"]}
          text-encoder: {command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]}
          orchestrator: {command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:7002"]}
        """,
    )
    with pytest.raises(ValueError, match=r"wan-t2v runs through .* no service of the compose file runs `serve vae`"):
        LocalCluster(_checkpoint(tmp_path / "wan"), compose_file=compose)
    with pytest.raises(ValueError, match=r"--model .*empty.*model_index.json"):
        LocalCluster(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"names the pipeline 'FluxPipeline', which this build does not serve"):
        LocalCluster(_checkpoint(tmp_path / "flux", "FluxPipeline"))


def test_the_image_override_drops_the_interpolator_and_only_its_endpoint() -> None:
    for file in VARIANTS:
        full, image = _resolved(file), _resolved(file, IMAGE_OVERRIDE)
        assert image["interp"]["profiles"], f"{file.name}: the interpolator would start with an image model"
        command = full["orchestrator"]["command"]
        at = command.index("--interp")
        assert image["orchestrator"]["command"] == command[:at] + command[at + 2 :], file.name
        assert image["orchestrator"]["depends_on"] == full["orchestrator"]["depends_on"], file.name


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_volumes_variables_and_environment_of_another_compose_file(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    compose = _write(
        tmp_path / "deploy" / "compose.yml",
        """
        services:
          enc:
            command: ["serve", "text-encoder", "--model", "/models/model", "--port", "7001",
                      "--cache-dir=/cache/enc", "--vocab", "/data"]
            volumes:
              - ${MODELS:-../models/default}:/models/model:ro
              - ${CACHE_DIR:-../cache}:/cache
              - ./data:/data
              - named:/ignored
            environment:
              - GREETING=hello ${WHO:-world}
              - FROM_HOST
          dit: {command: ["serve", "dit", "--model", "/m", "--port", "7002"]}
          vae: {command: ["serve", "vae", "--model", "/m", "--port", "7003"]}
          front:
            command: ["serve", "orchestrator", "--port=7000", "--text-encoder=enc:7001"]
            depends_on: [enc]
        volumes:
          named: {}
        """,
    )
    env = {"CACHE_DIR": "/var/cache/x", "FROM_HOST": "1"}
    cluster = LocalCluster(_checkpoint(tmp_path / "model"), compose_file=compose, env=env)
    plans = cluster.plan(local_ports={"enc": 9001, "front": 9000})
    assert plans["enc"].args == [
        "serve", "text-encoder", "--model", str((tmp_path / "model").resolve()), "--port", "9001",
        "--cache-dir=/var/cache/x/enc", "--vocab", str((tmp_path / "deploy" / "data").resolve()),
    ]  # fmt: skip
    assert plans["front"].args == [
        "serve", "orchestrator", "--port=9000", "--text-encoder=127.0.0.1:9001", "--state-dir", str(cluster.state_dir)
    ]  # fmt: skip
    assert plans["front"].waits_for == [], "a plain depends_on only orders the start"
    services = load_compose(compose, {"FROM_HOST": "1"})
    assert services["enc"].environment == {"GREETING": "hello world", "FROM_HOST": "1"}
    assert services["enc"].volumes[1] == (str((tmp_path / "cache").resolve()), "/cache")


def test_a_reference_to_a_port_the_service_does_not_serve_is_refused(tmp_path: Path) -> None:
    compose = _write(
        tmp_path / "compose.yml",
        """
        services:
          dit:
            command: ["serve", "dit", "--model", "/m", "--port", "7002"]
          text-encoder: {command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]}
          vae: {command: ["serve", "vae", "--model", "/m", "--port", "7003"]}
          orchestrator:
            command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:9999"]
        """,
    )
    with pytest.raises(ValueError, match="dit:9999"):
        LocalCluster(_checkpoint(tmp_path), compose_file=compose).plan()


def test_a_dependency_cycle_is_refused(tmp_path: Path) -> None:
    compose = _write(
        tmp_path / "compose.yml",
        """
        services:
          a:
            command: ["serve", "dit", "--port", "1"]
            depends_on: [b]
          b:
            command: ["serve", "orchestrator", "--port", "2"]
            depends_on: [a]
          text-encoder: {command: ["serve", "text-encoder", "--port", "3"]}
          vae: {command: ["serve", "vae", "--port", "4"]}
        """,
    )
    with pytest.raises(ValueError, match="cycle"):
        LocalCluster(_checkpoint(tmp_path), compose_file=compose).plan()


def test_interpolation_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}/$SET/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/$$SET/${UNSET}", env) == "x/x/d/d//$SET/"
    with pytest.raises(ValueError, match="NEEDED"):
        interpolate("${NEEDED:?set it}", env)


def test_wait_for_serving_gives_up_on_a_closed_port() -> None:
    port = free_ports(1, "127.0.0.1")[0]
    with pytest.raises(TimeoutError, match=str(port)):
        wait_for_serving(f"127.0.0.1:{port}", timeout=0.5)


@contextlib.contextmanager
def _readyz_server(status: int | None) -> Iterator[int]:
    """A stand-in for the gateway on a free port: GET /readyz answers `status` (None: nothing listens); yields the
    port."""
    if status is None:
        yield free_ports(1, "127.0.0.1")[0]
        return

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            """Quiet: the test reads the answers, not the server's log lines."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_gateway_is_ready_once_its_readyz_answers_200() -> None:
    """`stagediff up` waits on the HTTP gateway's GET /readyz, not grpc.health.v1: 503 (the orchestrator does not
    answer yet) and a closed port are not ready."""
    with _readyz_server(200) as port:
        assert is_http_ready(f"http://127.0.0.1:{port}/readyz")
        wait_for_http_ready(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert not is_http_ready(f"http://127.0.0.1:{port}/elsewhere")
    for status in (503, None):
        with _readyz_server(status) as port:
            assert not is_http_ready(f"http://127.0.0.1:{port}/readyz")
            with pytest.raises(TimeoutError, match=f"{port}/readyz"):
                wait_for_http_ready(f"http://127.0.0.1:{port}/readyz", timeout=0.5)


def test_a_gateway_serving_tls_is_waited_for_over_https(tmp_path: Path) -> None:
    compose = _write(
        tmp_path / "compose.yml",
        """
        services:
          text-encoder: {command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]}
          dit: {command: ["serve", "dit", "--model", "/m", "--port", "7002"]}
          vae: {command: ["serve", "vae", "--model", "/m", "--port", "7003"]}
          orchestrator: {command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:7002"]}
          web:
            command: ["serve", "http", "--port", "8000", "--orchestrator", "orchestrator:7000"]
            environment: {STAGEDIFF_TLS_CERT: /run/cert.pem, STAGEDIFF_TLS_KEY: /run/key.pem}
            depends_on: {orchestrator: {condition: service_healthy}}
          web-2: {command: ["serve", "http", "--port=8001", "--orchestrator=orchestrator:7000", "--tls-cert=c"]}
        """,
    )
    cluster = LocalCluster(_checkpoint(tmp_path / "model"), compose_file=compose, threads_per_stage=1)
    plans = cluster.plan(local_ports={"orchestrator": 9000, "web": 9100, "web-2": 9101})
    assert plans["web"].ready_url == "https://127.0.0.1:9100/readyz" and plans["web"].waits_for == ["orchestrator"]
    assert plans["web-2"].ready_url == "https://127.0.0.1:9101/readyz"
    assert plans["web-2"].args == ["serve", "http", "--port=9101", "--orchestrator=127.0.0.1:9000", "--tls-cert=c"]
    assert "web-2" not in cluster.stage_of, "`<name>-N` of a gateway is no stage replica"
    with pytest.raises(ValueError, match="not stages"):
        LocalCluster(cluster.model_dir, compose_file=compose, replicas={"web": 2})


def test_extends_env_files_and_secrets_resolve_against_the_file_that_writes_them(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "data").mkdir()
    _write(tmp_path / "base" / "base.env", "# base\nLEVEL=base\nSHARED='from base'\n")
    _write(
        tmp_path / "base" / "services.yml",
        """
        services:
          dit:
            command: ["serve", "dit", "--model", "/models/model", "--port", "7002", "--data", "/data"]
            env_file: base.env
            environment: {FROM_BASE: "1", SHARED: overridden-by-environment}
            volumes: ["./data:/data"]
            depends_on: [never-inherited]
        """,
    )
    _write(tmp_path / "top.env", "LEVEL=top\nexport EXPORTED=yes\n")
    (tmp_path / "key").write_text("k\n")
    compose = _write(
        tmp_path / "compose.yml",
        """
        services:
          dit:
            extends: {file: base/services.yml, service: dit}
            env_file: [top.env]
            secrets: [key, {source: key, target: /etc/key}]
            deploy: {resources: {reservations: {devices: [{driver: nvidia, device_ids: ["2"], capabilities: [gpu]}]}}}
          text-encoder: {command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]}
          vae: {command: ["serve", "vae", "--model", "/m", "--port", "7003"]}
          orchestrator:
            command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:7002", "--key", "/run/secrets/key"]
            secrets: [key]
            depends_on: {dit: {condition: service_healthy}}
        secrets:
          key: {file: ./key}
        """,
    )
    services = load_compose(compose, {})
    dit = services["dit"]
    assert dit.environment == {
        "LEVEL": "top", "SHARED": "overridden-by-environment", "EXPORTED": "yes", "FROM_BASE": "1"
    }  # fmt: skip
    assert dit.depends_on == {}, "compose never inherits depends_on through extends"
    key = str((tmp_path / "key").resolve())
    assert dit.volumes == [
        (str((tmp_path / "base" / "data").resolve()), "/data"), (key, "/run/secrets/key"), (key, "/etc/key")
    ]  # fmt: skip
    cluster = LocalCluster(_checkpoint(tmp_path / "model"), compose_file=compose)
    plans = cluster.plan(local_ports={"dit": 9002, "orchestrator": 9000})
    assert plans["dit"].args[-2:] == ["--data", str((tmp_path / "base" / "data").resolve())]
    assert plans["dit"].environment["CUDA_VISIBLE_DEVICES"] == "2"
    assert plans["orchestrator"].args[-4:-2] == ["--key", key]


def test_bad_extends_and_env_files_are_refused(tmp_path: Path) -> None:
    looped = _write(
        tmp_path / "loop.yml",
        """
        services:
          a: {extends: {service: b}, command: ["serve", "dit", "--port", "1"]}
          b: {extends: {service: a}}
        """,
    )
    with pytest.raises(ValueError, match="cycle"):
        load_compose(looped, {})
    _write(tmp_path / "bad.env", "GOOD=1\nthis line has no equals sign\n")
    with pytest.raises(ValueError, match=r"bad.env, line 2: expected KEY=VALUE"):
        read_env_file(tmp_path / "bad.env")
    with pytest.raises(ValueError, match="missing.env"):
        read_env_file(tmp_path / "missing.env")
    undeclared = _write(
        tmp_path / "undeclared.yml",
        """
        services:
          o: {command: ["serve", "orchestrator", "--port", "1"], secrets: [nowhere]}
        """,
    )
    with pytest.raises(ValueError, match="secret 'nowhere' is not declared"):
        load_compose(undeclared, {})


@pytest.mark.e2e
def test_stagediff_up_serves_an_image_model_without_an_interpolator(qwen_model: Path, tmp_path: Path) -> None:
    """The default compose file has an interp service; qwen-image's chain has none, so it never starts."""
    up_process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "up", "--model", str(qwen_model), "--port", "0", "--http-port", "0",
         "--threads-per-stage", "1", "--log-dir", str(tmp_path / "logs"), "--state-dir", str(tmp_path / "state"),
         "--startup-timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert up_process.stdout is not None
        deadline = time.monotonic() + 360
        for line in up_process.stdout:
            lines.append(line)
            if line.startswith("ready ") or time.monotonic() > deadline:
                break
        assert lines and lines[-1].startswith("ready "), "stagediff up did not get ready:\n" + "".join(lines[-40:])
        started = [line.split()[1] for line in lines if line.startswith("started ")]
        assert started == [*REQUIRED_STAGES, "orchestrator", GATEWAY]
        with Client(lines[-1].split()[1]) as client:
            result = client.generate("a fox", height=32, width=32, num_inference_steps=2, guidance_scale=1.0, seed=0)
        assert result.frames.shape == (1, 32, 32, 3)
        # The HTTP gateway is up too, ready (its orchestrator answers), before `ready` is printed.
        (http_url,) = [line.split()[1] for line in lines if line.startswith("http ")]
        assert is_http_ready(f"{http_url}/readyz", timeout=10)
    finally:
        up_process.send_signal(signal.SIGTERM)
        try:
            up_process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up_process.kill()
            up_process.wait()
