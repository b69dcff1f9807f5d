"""The compose topology as docker-compose itself resolves it (`docker-compose config`): health checks, ports,
secure defaults and TLS of every shipped file, and `stagediff up` serving an image model, whose chain has no
interpolator.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.auth import CLUSTER_SECRET_ENV
from services.stage_table import STAGES as STAGE_KINDS
from stagediff import Client
from stagediff.local.compose import load_compose, read_env_file
from stagediff.local.supervisor import is_http_ready
from tests.helpers.compose import (
    CPU_COMPOSE_FILE,
    DEPLOY,
    GATEWAY,
    GATEWAY_PORT,
    GPU_COMPOSE_FILE,
    REQUIRED_STAGES,
    STAGES,
    gateway_refusal,
    readyz_server,
)
from tests.helpers.secure_defaults import startup_refusal
from tests.helpers.serving import parse_serve

SINGLE_GPU_COMPOSE_FILE = DEPLOY / "docker-compose.single-gpu.yml"
STAGE_TLS_OVERRIDE = DEPLOY / "docker-compose.stage-tls.yml"
IMAGE_OVERRIDE = DEPLOY / "docker-compose.image.yml"
COMMON_SERVICES = DEPLOY / "common-services.yml"
VARIANTS = [GPU_COMPOSE_FILE, SINGLE_GPU_COMPOSE_FILE, CPU_COMPOSE_FILE]
HA_COMPOSE_FILE = DEPLOY / "docker-compose.ha.yml"
# Two models behind one orchestrator, a DiT each (tests/unit/test_compose_two_models.py checks its topology).
TWO_MODELS_COMPOSE_FILE = DEPLOY / "docker-compose.two-models.yml"
# Prometheus and Grafana over a cluster file (tests/unit/test_dashboards.py checks what they scrape and load).
MONITORING_OVERRIDE = DEPLOY / "docker-compose.monitoring.yml"


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
    [
        *((file,) for file in [*VARIANTS, COMMON_SERVICES, HA_COMPOSE_FILE, TWO_MODELS_COMPOSE_FILE]),
        *((file, IMAGE_OVERRIDE) for file in VARIANTS),
        *((file, MONITORING_OVERRIDE) for file in VARIANTS),
    ],
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
    with readyz_server(reply) as port:
        local = script.replace(f"localhost:{GATEWAY_PORT}/", f"localhost:{port}/")
        result = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=30)
    assert (result.returncode == 0) == (reply == 200), result.stderr


@pytest.mark.parametrize("file", [*VARIANTS, TWO_MODELS_COMPOSE_FILE], ids=lambda f: f.name)
def test_stagediff_up_reads_a_file_as_docker_compose_does(file: Path) -> None:
    resolved = _resolved(file)
    services = load_compose(file, {})
    assert set(services) == set(resolved)
    if file in VARIANTS:
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
        mounts = [(host, target) for host, target in service.volumes if not target.startswith("/run/secrets/")]
        assert sorted(mounts) == sorted(_bind_mounts(expected)), name


def _bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of each bind mount of a service, in either form docker-compose prints."""
    mounts = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):  # {type, source, target[, read_only]}
            if entry.get("type") == "bind":
                mounts.append((entry["source"], entry["target"]))
        elif entry.startswith("/"):  # "HOST:TARGET[:MODE]"; a named volume's source is a name
            host, target = entry.split(":")[:2]
            mounts.append((host, target))
    return mounts


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


def test_the_image_override_drops_the_interpolator_and_only_its_endpoint() -> None:
    for file in VARIANTS:
        full, image = _resolved(file), _resolved(file, IMAGE_OVERRIDE)
        assert image["interp"]["profiles"], f"{file.name}: the interpolator would start with an image model"
        command = full["orchestrator"]["command"]
        at = command.index("--interp")
        assert image["orchestrator"]["command"] == command[:at] + command[at + 2 :], file.name
        assert image["orchestrator"]["depends_on"] == full["orchestrator"]["depends_on"], file.name


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


def test_the_ha_file_runs_two_orchestrators_on_shared_storage_behind_one_port() -> None:
    """docker-compose.ha.yml: two orchestrators without volumes, each advertising its own address, both on the
    database and bucket of their env files (parsed by the orchestrator's own parser and configuration), behind one
    published port whose proxy checks both; the gateway is given both."""
    from services.orchestrator.config import OrchestratorConfig
    from services.orchestrator.store_location import PostgresLocation, S3Location

    services = _resolved(HA_COMPOSE_FILE)
    orchestrators = sorted(name for name in services if name.startswith("orchestrator"))
    assert orchestrators == ["orchestrator", "orchestrator-2"]
    assert _starts({name: services[name] for name in orchestrators}) == dict.fromkeys(orchestrators)
    for name in orchestrators:
        service = services[name]
        assert not service.get("volumes") and not _published(service), name
        environment = {key: str(value) for key, value in service["environment"].items()}
        with pytest.MonkeyPatch.context() as patch:
            for key, value in environment.items():
                patch.setenv(key, value)
            config = OrchestratorConfig.from_options(parse_serve(service["command"][1:]))
        assert isinstance(config.store, PostgresLocation) and isinstance(config.blobs, S3Location), name
        assert config.advertise == f"{name}:50051"
        assert {"postgres", "seaweedfs"} <= set(service["depends_on"])
    assert [target for _, target in _published(services["haproxy"])] == ["50051"]
    backends = (DEPLOY / "ha" / "haproxy.cfg").read_text()
    assert all(f"server {name} {name}:50051 check" in backends for name in orchestrators)
    assert services[GATEWAY]["command"][-1] == "orchestrator:50051,orchestrator-2:50051"
