"""Secure by default: servers and metrics bind loopback, stages need the cluster secret, and an orchestrator
with tenants refuses to send API keys in clear beyond this machine, unless told --insecure."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import CLUSTER_SECRET_ENV
from services.orchestrator.tenants import hash_api_key
from tests.helpers.secure_defaults import STAGES

STARTUP_TIMEOUT = 120


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
