"""The compose topology and how `stagediff up` turns it into local commands (no processes started)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagediff import local_cluster
from stagediff.local_cluster import DEFAULT_COMPOSE_FILE, LocalCluster, interpolate, load_compose

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CPU_OVERRIDE = DEPLOY / "docker-compose.cpu.yml"
STAGES = {"text-encoder": 50061, "dit": 50062, "vae": 50063, "interp": 50064}
LOCAL_PORTS = {"text-encoder": 41001, "dit": 41002, "vae": 41003, "interp": 41004, "orchestrator": 41000}


def test_default_compose_file_is_the_repository_one() -> None:
    assert DEFAULT_COMPOSE_FILE == COMPOSE_FILE


# -- the topology itself ------------------------------------------------------


def _topology() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def test_every_stage_reserves_gpus_and_has_a_health_check() -> None:
    services = _topology()
    assert set(services) == {*STAGES, "orchestrator"}
    for name, port in STAGES.items():
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d["device_ids"] for d in devices), name
        health = ["CMD", "stagediff", "health", "--endpoint", f"localhost:{port}"]
        assert services[name]["healthcheck"]["test"] == health
        assert services[name]["healthcheck"]["start_period"]
        assert "${STAGEDIFF_MODEL_DIR:-../models/tiny}:/models/model:ro" in services[name]["volumes"]
    gpus = [
        g
        for name in STAGES
        for d in services[name]["deploy"]["resources"]["reservations"]["devices"]
        for g in d["device_ids"]
    ]
    assert sorted(gpus) == [str(g) for g in range(8)], "the 8-GPU example gives each GPU to one stage"


def test_orchestrator_waits_for_every_stage_to_be_healthy() -> None:
    orchestrator = _topology()["orchestrator"]
    assert orchestrator["depends_on"] == {name: {"condition": "service_healthy"} for name in STAGES}
    assert orchestrator["ports"] == ["${STAGEDIFF_PORT:-50051}:50051"]
    assert orchestrator["healthcheck"]["test"][-1] == "localhost:50051"
    for name, port in STAGES.items():
        assert f"{name}:{port}" in orchestrator["command"]


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail("docker-compose is not on PATH: install Debian's package (apt-get install -y docker-compose)")
    return path


def _compose_version(binary: str) -> tuple[int, ...]:
    text = subprocess.run([binary, "version", "--short"], capture_output=True, text=True, check=True).stdout
    return tuple(int(part) for part in text.strip().lstrip("v").split(".")[:2])


def _config(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, *args, "config"], capture_output=True, text=True, cwd=DEPLOY.parent)


def test_docker_compose_accepts_the_topology() -> None:
    result = _config(_docker_compose(), "-f", str(COMPOSE_FILE))
    assert result.returncode == 0, result.stderr


class _ResetLoader(yaml.SafeLoader):
    """Reads compose's `!reset` tag (Compose v2.24+) as a marker, for tools that predate it."""


_RESET = object()
_ResetLoader.add_constructor("!reset", lambda loader, node: _RESET)


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override into a base, for the mapping keys and `!reset` that our override uses."""
    if not isinstance(override, dict):
        return override
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in override.items():
        if value is _RESET:
            merged.pop(key, None)
        else:
            merged[key] = _merge(merged.get(key), value)
    return merged


def test_cpu_override_removes_every_gpu_reservation(tmp_path: Path) -> None:
    binary = _docker_compose()
    if _compose_version(binary) >= (2, 24):
        result = _config(binary, "-f", str(COMPOSE_FILE), "-f", str(CPU_OVERRIDE))
        assert result.returncode == 0, result.stderr
        config = yaml.safe_load(result.stdout)
    else:
        # Compose v1 cannot read `!reset`: apply the override here and let it validate the result.
        base = yaml.load(COMPOSE_FILE.read_text(), Loader=_ResetLoader)
        merged = _merge(base, yaml.load(CPU_OVERRIDE.read_text(), Loader=_ResetLoader))
        merged_file = tmp_path / "docker-compose.cpu-merged.yml"
        merged_file.write_text(yaml.safe_dump(merged))
        result = _config(binary, "-f", str(merged_file), "--project-directory", str(DEPLOY))
        assert result.returncode == 0, result.stderr
        config = yaml.safe_load(result.stdout)
    for name in STAGES:
        reservations = (config["services"][name].get("deploy") or {}).get("resources", {}).get("reservations", {})
        assert not reservations.get("devices"), f"{name} still reserves GPUs: {reservations}"
        assert config["services"][name]["healthcheck"]
    assert config["services"]["orchestrator"]["depends_on"]["dit"] == {"condition": "service_healthy"}


# -- rewriting commands for local processes ----------------------------------


def test_commands_get_local_ports_hosts_references_and_model_path(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, port=0)
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    assert list(plans) == [*STAGES, "orchestrator"], "stages first: the orchestrator depends on all of them"
    model = str(tmp_path.resolve())
    for name in STAGES:
        assert plans[name].args == [
            "serve", name, "--model", model, "--host", "127.0.0.1", "--port", str(LOCAL_PORTS[name])
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
    assert orchestrator.waits_for == list(STAGES)


def test_free_ports_are_distinct_and_the_orchestrator_takes_the_requested_one(tmp_path: Path) -> None:
    free = LocalCluster(tmp_path, port=0).plan()
    ports = [plan.port for plan in free.values()]
    assert len(set(ports)) == len(ports) and all(port > 0 for port in ports)
    fixed = LocalCluster(tmp_path, port=43210).plan()
    assert fixed["orchestrator"].port == 43210
    assert fixed["orchestrator"].args[fixed["orchestrator"].args.index("--port") + 1] == "43210"
    assert 43210 not in [plan.port for name, plan in fixed.items() if name != "orchestrator"]


def test_a_wildcard_host_is_bound_but_reached_through_loopback(tmp_path: Path) -> None:
    plans = LocalCluster(tmp_path, host="0.0.0.0").plan(local_ports=LOCAL_PORTS)
    assert plans["dit"].args[plans["dit"].args.index("--host") + 1] == "0.0.0.0"
    assert plans["dit"].endpoint == "127.0.0.1:41002"
    assert "127.0.0.1:41002" in plans["orchestrator"].args


def test_threads_and_extra_args_go_to_the_stages_they_concern(tmp_path: Path) -> None:
    extra_args = {"dit": ["--ulysses-degree", "2"], "vae": ["--vae-patch-parallel-size", "2"]}
    cluster = LocalCluster(tmp_path, threads_per_stage=2, extra_args=extra_args)
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    assert plans["dit"].args[-4:] == ["--threads", "2", "--ulysses-degree", "2"]
    assert plans["vae"].args[-4:] == ["--threads", "2", "--vae-patch-parallel-size", "2"]
    assert plans["text-encoder"].args[-2:] == ["--threads", "2"]
    assert "--threads" not in plans["orchestrator"].args
    with pytest.raises(ValueError, match="not in"):
        LocalCluster(tmp_path, extra_args={"ditt": ["--usp", "2"]})


def test_up_routes_stage_flags_to_their_stage() -> None:
    parser = argparse.ArgumentParser()
    local_cluster.add_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--model", "m", "--embedding-cache-size", "16"])
    assert args.func is local_cluster._up
    assert args.port == 50051 and args.file == str(DEFAULT_COMPOSE_FILE) and args.host == "127.0.0.1"
    assert local_cluster.stage_flags(args) == {
        "text-encoder": ["--embedding-cache-size", "16"],
    }


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
          front:
            command: ["serve", "orchestrator", "--port=7000", "--text-encoder=enc:7001"]
            depends_on: [enc]
        volumes:
          named: {}
        """,
    )
    env = {"CACHE_DIR": "/var/cache/x", "FROM_HOST": "1"}
    cluster = LocalCluster(tmp_path / "model", compose_file=compose, env=env)
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
          orchestrator:
            command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:9999"]
        """,
    )
    with pytest.raises(ValueError, match="dit:9999"):
        LocalCluster(tmp_path, compose_file=compose).plan()


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
        """,
    )
    with pytest.raises(ValueError, match="cycle"):
        LocalCluster(tmp_path, compose_file=compose).plan()


def test_interpolation_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}/$SET/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/$$SET/${UNSET}", env) == "x/x/d/d//$SET/"
    with pytest.raises(ValueError, match="NEEDED"):
        interpolate("${NEEDED:?set it}", env)


def test_wait_for_serving_gives_up_on_a_closed_port() -> None:
    port = local_cluster.free_ports(1, "127.0.0.1")[0]
    with pytest.raises(TimeoutError, match=str(port)):
        local_cluster.wait_for_serving(f"127.0.0.1:{port}", timeout=0.5)
