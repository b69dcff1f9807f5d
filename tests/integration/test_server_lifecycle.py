"""Every service: health, reflection, and a graceful exit on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stagediff.local.supervisor import wait_for_serving
from tests.helpers.grpc_channels import stage_channel
from tests.helpers.serving import run_together


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("stage", "service"),
    [("text-encoder", "stagediff.v1.TextEncoder"), ("vae", "stagediff.v1.VaeDecoder")],
)
def test_stage_serves_reflection_and_exits_cleanly_on_sigterm(tiny_model, tmp_path, stage, service) -> None:
    port = _free_port()
    log = (tmp_path / "log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "serve",
            stage,
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_serving(f"127.0.0.1:{port}", timeout=120)
        with stage_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for s in next(responses).list_services_response.service}
        assert {service, "stagediff.v1.StageControl", "grpc.health.v1.Health"} <= names
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert "draining" in (tmp_path / "log").read_text()


@pytest.fixture(scope="module")
def refusals(tiny_model, tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The stages that refuse their flags at startup, side by side: each refuses after its imports."""
    serve = [sys.executable, "-m", "stagediff.cli", "serve"]
    commands = {
        "missing checkpoint": [*serve, "dit", "--model", str(tmp_path_factory.mktemp("models") / "nope")],
        "no load threads": [*serve, "vae", "--model", str(tiny_model), "--num-weight-load-threads", "0"],
    }
    finished = run_together([[*command, "--port", "0"] for command in commands.values()], timeout=300)
    return dict(zip(commands, finished, strict=True))


def test_a_missing_checkpoint_fails_at_startup_with_a_clear_error(refusals) -> None:
    completed = refusals["missing checkpoint"]
    assert completed.returncode != 0
    (line,) = completed.stderr.strip().splitlines()  # one line, no traceback
    assert "nope: no such directory" in line and "stagediff init-model" in line, line


def test_weight_load_threads_flags_are_checked(refusals) -> None:
    completed = refusals["no load threads"]
    assert completed.returncode != 0 and "--num-weight-load-threads 0: use 1 or more" in completed.stderr
