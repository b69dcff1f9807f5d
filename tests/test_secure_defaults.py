"""Secure by default: servers and metrics bind loopback, stages need the cluster secret, and an orchestrator
with tenants refuses to send API keys in clear beyond this machine, unless told --insecure."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import CLUSTER_SECRET_ENV
from services.orchestrator.service import check_exposure
from services.orchestrator.tenants import TenantRegistry, hash_api_key
from services.server import is_loopback
from services.stage_table import SERVE_TARGETS
from tests.conftest import parse_serve

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
STAGES = ("text-encoder", "dit", "vae", "interp")
STARTUP_TIMEOUT = 120


def serve_defaults(target: str, *flags: str) -> argparse.Namespace:
    """The options `stagediff serve <target>` runs with, given `flags` and placeholders for the required ones."""
    if target == "orchestrator":
        required = [argument for stage in STAGES for argument in (f"--{stage}", "127.0.0.1:1")]
    elif target == "http":
        required = []  # the gateway's options all have defaults
    else:
        required = ["--model", "m"]
    return parse_serve([target, *required, *flags])


def startup_refusal(target: str, args: argparse.Namespace, has_secret: bool) -> str | None:
    """What `stagediff serve <target>` with `args` would refuse to start for (secret, tenants without TLS), or
    None; `has_secret` says whether a cluster secret reaches it (a file or the environment)."""
    from services.stage_main import _secret_interceptors

    secret_env = {CLUSTER_SECRET_ENV: "a-cluster-secret"} if has_secret else {}
    environment = {key: value for key, value in os.environ.items() if key != CLUSTER_SECRET_ENV} | secret_env
    try:
        if target != "orchestrator":
            with mock.patch.dict(os.environ, environment, clear=True):
                _secret_interceptors(target, argparse.Namespace(cluster_secret_file=None, insecure=args.insecure))
        else:
            tenants = _tenants() if args.tenants else TenantRegistry.open()
            credentials = grpc.local_server_credentials() if args.tls_cert else None
            check_exposure(args, tenants, "a-cluster-secret" if has_secret else None, credentials)
    except SystemExit as refused:
        return str(refused)
    return None


# -------------------------------------------------------------- binding --


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_every_server_binds_loopback_unless_told_otherwise(target: str) -> None:
    assert serve_defaults(target).host == "127.0.0.1"
    assert serve_defaults(target, "--host", "0.0.0.0").host == "0.0.0.0"


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.7", "orchestrator", "2001:db8::1"):
        assert not is_loopback(host), host


def _listening(port: int) -> set[str]:
    """The addresses on which a TCP socket of this machine listens on `port` (Linux /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                    continue
                # Each 32-bit word of the address is in the host's (little-endian) byte order.
                packed = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
                ip = ipaddress.ip_address(packed)
                # grpc may bind an IPv4 address through an IPv6 socket, as ::ffff:a.b.c.d.
                found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def _outward_address() -> str | None:
    """This machine's address on its default route, or None without one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _answers_health(target: str) -> int:
    """The health status `target` answers (NOT_SERVING counts: the port is bound while the server loads)."""
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest()
        return health_pb2_grpc.HealthStub(channel).Check(request, wait_for_ready=True, timeout=STARTUP_TIMEOUT).status


@pytest.mark.parametrize("target", ["interp", "orchestrator"])
def test_a_started_server_and_its_metrics_are_reachable_only_on_loopback(
    target: str, tiny_model: Path, tmp_path: Path
) -> None:
    port, metrics_port = _free_ports(2)
    if target == "orchestrator":  # stages that never answer: the orchestrator binds, then waits for them
        flags = [argument for stage in STAGES for argument in (f"--{stage}", "127.0.0.1:1")]
        flags += ["--state-dir", str(tmp_path / "state")]
    else:
        flags = ["--model", str(tiny_model), "--threads", "1"]
    log = (tmp_path / "log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "serve", target, *flags,
         "--port", str(port), "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _answers_health(f"127.0.0.1:{port}")
        bound = {"grpc": _listening(port), "metrics": _listening(metrics_port)}
        outward = _outward_address()
        reached_outward = []
        if outward is not None:
            for probed in (port, metrics_port):
                with contextlib.suppress(OSError), socket.create_connection((outward, probed), timeout=5):
                    reached_outward.append(probed)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    assert bound == {"grpc": {"127.0.0.1"}, "metrics": {"127.0.0.1"}}, (tmp_path / "log").read_text()[-2000:]
    assert reached_outward == [], f"reachable on {outward}"
    assert f"listening on 127.0.0.1:{port}" in (tmp_path / "log").read_text()


# ------------------------------------------------------ stage secret --


def test_a_stage_without_a_cluster_secret_refuses_to_start(tiny_model: Path) -> None:
    environment = {key: value for key, value in os.environ.items() if key != CLUSTER_SECRET_ENV}
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", "interp", "--model", str(tiny_model), "--port", "0",
         "--threads", "1"],
        capture_output=True, text=True, env=environment, timeout=STARTUP_TIMEOUT,
    )  # fmt: skip
    assert completed.returncode != 0
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith("stagediff serve interp: no cluster secret"), completed.stderr[-2000:]
    for flag in ("--cluster-secret-file", f"${CLUSTER_SECRET_ENV}", "--insecure"):
        assert flag in last


# ------------------------------------------------------- orchestrator --


def _tenants() -> TenantRegistry:
    return TenantRegistry.from_dict({"tenants": [{"name": "acme", "api_keys": [hash_api_key("sd_" + "k" * 43)]}]})


def _options(host: str, insecure: bool = False) -> argparse.Namespace:
    return argparse.Namespace(host=host, insecure=insecure)


def test_tenants_on_a_non_loopback_host_need_tls_or_insecure(caplog) -> None:
    tls = grpc.local_server_credentials()  # credentials of any kind stand for --tls-cert/--tls-key here
    for host in ("0.0.0.0", "::", "10.0.0.7"):
        with pytest.raises(SystemExit) as refused:
            check_exposure(_options(host), _tenants(), "secret", None)
        message = str(refused.value)
        assert message.startswith(f"stagediff serve orchestrator: --tenants on --host {host} without TLS")
        for flag in ("--tls-cert", "--tls-key", "--insecure"):
            assert flag in message
        check_exposure(_options(host), _tenants(), "secret", tls)
        check_exposure(_options(host), TenantRegistry.open(), "secret", None)  # the open tenant has no key to leak
    check_exposure(_options("127.0.0.1"), _tenants(), "secret", None)
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.service"):
        check_exposure(_options("0.0.0.0", insecure=True), _tenants(), "secret", None)
    assert "--insecure: API keys reach --host 0.0.0.0 in clear" in caplog.text


def test_an_orchestrator_without_a_cluster_secret_needs_insecure(caplog) -> None:
    with pytest.raises(SystemExit) as refused:
        check_exposure(_options("127.0.0.1"), TenantRegistry.open(), None, None)
    for flag in ("--cluster-secret-file", f"${CLUSTER_SECRET_ENV}", "--insecure"):
        assert flag in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.service"):
        check_exposure(_options("127.0.0.1", insecure=True), TenantRegistry.open(), None, None)
    assert "only stages started with --insecure will answer" in caplog.text


def test_the_orchestrator_refuses_to_start_with_tenants_on_0_0_0_0_without_tls(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: acme\n    api_keys: ['{hash_api_key('sd_' + 'k' * 43)}']\n")
    stages = [argument for stage in STAGES for argument in (f"--{stage}", "127.0.0.1:1")]
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", "orchestrator", *stages, "--host", "0.0.0.0",
         "--port", "0", "--tenants", str(tenants), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
    )  # fmt: skip
    assert completed.returncode != 0
    last = completed.stderr.strip().splitlines()[-1]
    assert "--tenants on --host 0.0.0.0 without TLS" in last and "--insecure" in last, completed.stderr[-2000:]
    assert not (tmp_path / "state").exists(), "refused before anything was created"


def test_node_0_of_a_multinode_group_must_bind_where_the_other_nodes_reach_it() -> None:
    """Its control channel binds --host: loopback cannot be reached at another machine's --master-addr."""
    from dit_svc.service import check_node_layout, parallel_config_from

    layout = ("--ulysses-degree", "2", "--nnodes", "2", "--master-addr", "dit-group-0.dit-group")
    args = serve_defaults("dit", *layout)
    with pytest.raises(SystemExit) as refused:
        check_node_layout(args, parallel_config_from(args))
    assert "--host 127.0.0.1" in str(refused.value) and "--master-addr dit-group-0.dit-group" in str(refused.value)
    everywhere = serve_defaults("dit", *layout, "--host", "0.0.0.0")
    check_node_layout(everywhere, parallel_config_from(everywhere))
    on_one_machine = serve_defaults("dit", "--ulysses-degree", "2", "--nnodes", "2")  # master-addr 127.0.0.1
    check_node_layout(on_one_machine, parallel_config_from(on_one_machine))


def test_the_http_gateway_refuses_plain_http_beyond_loopback() -> None:
    from services.gateway.service import startup_problem

    assert startup_problem(serve_defaults("http")) is None  # 127.0.0.1
    refused = startup_problem(serve_defaults("http", "--host", "0.0.0.0"))
    assert refused is not None and "--insecure" in refused and "in clear" in refused
    assert startup_problem(serve_defaults("http", "--host", "0.0.0.0", "--insecure")) is None
    assert (
        startup_problem(serve_defaults("http", "--host", "0.0.0.0", "--tls-cert", "c.pem", "--tls-key", "k.pem"))
        is None
    )
    assert "go together" in startup_problem(serve_defaults("http", "--tls-cert", "c.pem"))
