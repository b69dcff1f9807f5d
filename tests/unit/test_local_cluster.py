"""How `stagediff up` turns the compose topology into local commands: ports, hosts, secrets, flags, extends and
env files, and the waits for a stage and the gateway. No process is started.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from services.auth import CLUSTER_SECRET_ENV
from services.stage_table import STAGES as STAGE_KINDS
from stagediff.local import up
from stagediff.local.compose import DEFAULT_COMPOSE_FILE, interpolate, load_compose, read_env_file
from stagediff.local.launch import free_ports
from stagediff.local.supervisor import LocalCluster, is_http_ready, wait_for_http_ready, wait_for_serving
from tests.helpers.compose import (
    CPU_COMPOSE_FILE,
    GATEWAY,
    GATEWAY_PORT,
    GPU_COMPOSE_FILE,
    REQUIRED_STAGES,
    STAGES,
    readyz_server,
)

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
    assert args.port == 50051 and args.file is None and args.host == "127.0.0.1"
    assert args.http_port == GATEWAY_PORT
    assert up.stage_flags(vars(args)) == {
        "text-encoder": ["--embedding-cache-size", "16"],
        "dit": ["--ulysses-degree", "2", "--use-hsdp"],
        "vae": ["--vae-use-tiling"],
    }


def test_up_passes_each_value_of_a_repeated_flag_after_its_own_flag() -> None:
    args = up.build_parser().parse_args(["--model", "m", "--lora-dir", "d", "--lora", "a", "--lora", "b:0.5"])
    assert up.stage_flags(vars(args)) == {"dit": ["--lora-dir", "d", "--lora", "a", "--lora", "b:0.5"]}


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
        LocalCluster(qwen.model_dir, extra_args=up.stage_flags(vars(up.build_parser().parse_args(
            ["--model", "m", "--interp-model-path", "rife.pkl"]
        ))))  # fmt: skip
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
    with pytest.raises(ValueError, match=r"--model .*missing: no such directory; .*stagediff init-model"):
        LocalCluster(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--model .*empty: the directory has no model_index.json"):
        LocalCluster(tmp_path / "empty")
    with pytest.raises(
        ValueError, match=r"names the pipeline 'StableDiffusionXLPipeline', which this build does not serve"
    ):
        LocalCluster(_checkpoint(tmp_path / "sdxl", "StableDiffusionXLPipeline"))


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


def test_the_gateway_is_ready_once_its_readyz_answers_200() -> None:
    """`stagediff up` waits on the HTTP gateway's GET /readyz, not grpc.health.v1: 503 (the orchestrator does not
    answer yet) and a closed port are not ready."""
    with readyz_server(200) as port:
        assert is_http_ready(f"http://127.0.0.1:{port}/readyz")
        wait_for_http_ready(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert not is_http_ready(f"http://127.0.0.1:{port}/elsewhere")
    for status in (503, None):
        with readyz_server(status) as port:
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


def test_orchestrator_replicas_get_ports_state_dirs_and_addresses_of_their_own(tmp_path: Path) -> None:
    """`stagediff up --orchestrators 2`: a second orchestrator beside the first, each with its own port, state
    directory and advertised address; the gateway is given both."""
    extra = {"orchestrator": ["--store", "postgresql://stagediff@127.0.0.1:5432/stagediff"]}
    cluster = LocalCluster(_checkpoint(tmp_path), port=0, orchestrators=2, extra_args=extra)
    plans = cluster.plan(local_ports=LOCAL_PORTS)
    assert list(plans) == [*STAGES, "orchestrator", "orchestrator-2", GATEWAY]
    first, second = plans["orchestrator"], plans["orchestrator-2"]
    assert first.port == 41000 and second.port not in LOCAL_PORTS.values()

    def option(plan, flag: str) -> list[str]:
        return [plan.args[index + 1] for index, arg in enumerate(plan.args) if arg == flag]

    assert option(first, "--advertise") == ["127.0.0.1:41000"]
    assert option(second, "--advertise") == [second.endpoint] and option(second, "--port") == [str(second.port)]
    assert option(first, "--state-dir")[-1] == str(cluster.state_dir)
    assert set(option(second, "--state-dir")) == {str(cluster.state_dir / "replica-2")}
    assert option(second, "--store") == option(first, "--store") == extra["orchestrator"][1:]
    assert option(plans[GATEWAY], "--orchestrator") == [f"127.0.0.1:41000,{second.endpoint}"]


def test_up_refuses_replicas_without_a_shared_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert up.run(up.build_parser().parse_args(["--model", "m", "--orchestrators", "2"])) == 2
    assert "--store postgresql://USER@HOST/DB, or --store local-postgres" in capsys.readouterr().err
