"""Ports are exclusive, and `stagediff up` reports ready only with services of its own.

A second server on a taken port fails at startup naming the port and its flag, while the first goes on
answering; `stagediff up` refuses taken ports and a state dir in use before it starts anything; and an answer
that lacks the launch id given to a process (another server on the port) never counts as that process ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from services.launch_id import LAUNCH_ID_ENV
from services.orchestrator.store import JobStore
from stagediff.local.health import wait_for_http_ready
from stagediff.local.ownership import grpc_ready_as, http_ready_as
from stagediff.local.supervisor import CLUSTER_SECRET_ENV
from tests.helpers.ports import STARTUP_TIMEOUT_S, foreign_grpc_server

# Generous bounds for a hang: a process that should exit at once runs until these.
EXIT_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _listener() -> Iterator[int]:
    """Another process's server, as far as a port goes: a socket listening on a free port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(args: list[str], log: Path, launch_id: str) -> subprocess.Popen[bytes]:
    environment = {**os.environ, CLUSTER_SECRET_ENV: "test-secret", LAUNCH_ID_ENV: launch_id}
    return subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=environment
    )


def _wait_for(check, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} within {STARTUP_TIMEOUT_S} s"
        time.sleep(0.25)


def test_a_second_server_on_a_taken_port_exits_naming_it_and_the_first_still_answers(tmp_path: Path) -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    first = _serve(["serve", "interp", "--port", str(port)], tmp_path / "first.log", launch_id="first")
    try:
        _wait_for(lambda: grpc_ready_as(endpoint, "first", timeout=1.0), "the first interp serving")
        second = subprocess.run(
            [sys.executable, "-m", "stagediff.cli", "serve", "interp", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT_S,
            env={**os.environ, CLUSTER_SECRET_ENV: "test-secret"},
        )
        assert second.returncode != 0
        last = second.stderr.strip().splitlines()[-1]
        assert f"port {port} is already in use (--port)" in last, second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        # Every health check is the first server's: the launch id it was given, not another's.
        assert all(grpc_ready_as(endpoint, "first", timeout=5.0) for _ in range(8))
    finally:
        first.terminate()
        first.wait(30)


def test_the_gateway_refuses_a_taken_port_naming_its_flag() -> None:
    with _listener() as port:
        completed = subprocess.run(
            [sys.executable, "-m", "stagediff.cli", "serve", "http", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT_S,
        )
    assert completed.returncode != 0
    assert f"port {port} is already in use (--port)" in completed.stderr.strip().splitlines()[-1], completed.stderr


def test_the_gateways_readyz_answers_with_its_launch_id(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/readyz"
    with foreign_grpc_server() as orchestrator:
        gateway = _serve(
            ["serve", "http", "--port", str(port), "--orchestrator", orchestrator], tmp_path / "gw.log", "gw-1"
        )
        try:
            wait_for_http_ready(url, timeout=STARTUP_TIMEOUT_S)
            assert http_ready_as(url, "gw-1", timeout=5.0)
            assert not http_ready_as(url, "another-launch", timeout=5.0)
        finally:
            gateway.terminate()
            gateway.wait(30)


def test_up_refuses_taken_ports_and_a_state_dir_in_use_before_starting_anything(tmp_path: Path) -> None:
    """One line each, naming --port, --http-port and --state-dir; nothing is started (the model directory holds
    no weights: a stage that started would fail otherwise)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    state_dir = tmp_path / "state"
    store = JobStore.open(state_dir)  # what a running cluster's orchestrator holds
    try:
        with _listener() as port, _listener() as http_port:
            completed = subprocess.run(
                [sys.executable, "-m", "stagediff.cli", "up", "--model", str(model), "--port", str(port),
                 "--http-port", str(http_port), "--state-dir", str(state_dir), "--log-dir", str(tmp_path / "logs")],
                capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
            )  # fmt: skip
    finally:
        store.close()
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "started" not in completed.stdout and "ready" not in completed.stdout
    lines = completed.stderr.strip().splitlines()
    assert f"stagediff up: port {port} is already in use (--port): another process listens there" in lines[0]
    assert f"port {http_port} is already in use (--http-port)" in lines[1]
    assert f"--state-dir {state_dir} is in use by another running cluster" in lines[2]
    assert len(lines) == 3, completed.stderr
    assert not list((tmp_path / "logs").glob("*.log")), "no service was started"
