"""A `stagediff up` and its services live and die together, and `stagediff ps` / `stagediff down` find it.

One `up` serves the tiny model by its Hugging Face Hub id from an offline Hub cache (services/model_source.py);
`ps` lists it, and once it is SIGKILLed every service it started ends, its ports and its state dir's lock are
free, and `ps` drops its record. A second `up` (started with the first, to share the wait), stopped by `down`,
exits cleanly and leaves no record.
The pipe and the death signal each end a watched process on their own (services/supervised.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.ports import bind_problem
from stagediff import Client
from stagediff.cluster_registry import process_start_ticks
from stagediff.local.ownership import state_dir_problem
from tests.helpers.hub_cache import cache_checkpoint

REPO = "Wan-AI/Wan-tiny-Diffusers"
STARTUP_TIMEOUT_S = 300
# Generous bounds for a hang: services that must end at once (idle, nothing to drain) end well within it.
END_TIMEOUT_S = 60


@dataclass
class RunningUp:
    process: subprocess.Popen[str]
    lines: list[str]
    environment: dict[str, str]
    state_dir: Path

    @property
    def endpoint(self) -> str:
        return self.lines[-1].split()[1]

    @property
    def service_pids(self) -> list[int]:
        return [int(line.split("pid=")[1].split()[0]) for line in self.lines if line.startswith("started ")]

    @property
    def ports(self) -> list[int]:
        return [int(line.rpartition(":")[2]) for line in self.lines if line.startswith("started ")]


@pytest.fixture(scope="module")
def hub_environment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a user whose Hub cache holds the tiny model as REPO, offline, with a registry of
    their own."""
    home = tmp_path_factory.mktemp("hub-user")
    cache_checkpoint(tiny_model, home / "hub", REPO)
    return {
        **os.environ,
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "1",
        "XDG_RUNTIME_DIR": str(home / "run"),
    }


def _launch(environment: dict[str, str], workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "up", "--model", REPO, "--port", "0", "--http-port", "0",
         "--threads-per-stage", "1", "--log-dir", str(workdir / "logs"), "--state-dir", str(workdir / "state"),
         "--startup-timeout", str(STARTUP_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
    )  # fmt: skip


def _ready(process: subprocess.Popen[str], environment: dict[str, str], workdir: Path) -> RunningUp:
    lines: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("ready "):
            return RunningUp(process, lines, environment, workdir / "state")
    process.wait()
    raise AssertionError("stagediff up did not get ready:\n" + "".join(lines[-40:]))


def _end(up: RunningUp) -> None:
    """Stops `up` if it still runs, and kills any service of it a failed test left behind."""
    if up.process.poll() is None:
        up.process.send_signal(signal.SIGTERM)
        up.process.wait(timeout=END_TIMEOUT_S)
    for pid in up.service_pids:
        if process_start_ticks(pid) is not None:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def two_ups(hub_environment: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningUp]]:
    """Two `up`s of the Hub id, started together to share the wait: one to kill, one to stop with `down`."""
    workdirs = [tmp_path_factory.mktemp("up") for _ in range(2)]
    processes = [_launch(hub_environment, workdir) for workdir in workdirs]
    ups: list[RunningUp] = []
    try:
        for process, workdir in zip(processes, workdirs, strict=True):
            ups.append(_ready(process, hub_environment, workdir))
        yield ups
    finally:
        for up in ups:
            _end(up)
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _stagediff(environment: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stagediff.cli", *args], capture_output=True, text=True, env=environment, timeout=120
    )


def _ps(environment: dict[str, str]) -> list[dict]:
    result = _stagediff(environment, "ps", "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` again (as `up` checks: connections left in TIME_WAIT do not count)."""
    return bind_problem("127.0.0.1", port, "--port") is None


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + END_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {END_TIMEOUT_S} s"
        time.sleep(0.2)


def test_the_services_of_a_killed_up_end_and_free_its_ports_and_state_dir(two_ups: list[RunningUp]) -> None:
    running_up = two_ups[0]
    (listed,) = [record for record in _ps(running_up.environment) if record["pid"] == running_up.process.pid]
    assert listed["pid"] == running_up.process.pid
    assert listed["endpoint"] == running_up.endpoint
    assert listed["models"] == ["Wan-tiny-Diffusers"]  # the Hub id's name, served from its cached snapshot
    assert listed["state_dir"] == str(running_up.state_dir.resolve())
    with Client(running_up.endpoint) as client:
        result = client.generate("a fox", model="Wan-tiny-Diffusers", height=32, width=32, num_frames=1,
                                 num_inference_steps=2, guidance_scale=1.0, seed=0)  # fmt: skip
    assert result.frames.shape == (1, 32, 32, 3)
    pids, ports = running_up.service_pids, running_up.ports
    assert len(pids) >= 5  # text encoder, DiT, VAE, interpolator, orchestrator, gateway
    assert all(process_start_ticks(pid) is not None for pid in pids)

    running_up.process.send_signal(signal.SIGKILL)
    running_up.process.wait()

    _wait_until(lambda: all(process_start_ticks(pid) is None for pid in pids), "every service of the killed up ended")
    _wait_until(lambda: all(map(_port_is_free, ports)), "every port of the killed up was free")
    assert state_dir_problem(running_up.state_dir) is None
    # Its record outlived it: `ps` drops it.
    record = Path(running_up.environment["XDG_RUNTIME_DIR"]) / "stagediff" / "clusters" / f"{listed['pid']}.json"
    assert record.is_file()
    assert listed["pid"] not in [other["pid"] for other in _ps(running_up.environment)]
    assert not record.exists()


def test_down_stops_an_up_by_its_port_and_ps_no_longer_lists_it(two_ups: list[RunningUp]) -> None:
    running_up = two_ups[1]
    assert running_up.process.pid in [record["pid"] for record in _ps(running_up.environment)]
    port = running_up.endpoint.rpartition(":")[2]
    result = _stagediff(running_up.environment, "down", port)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"stopped the cluster at {running_up.endpoint} (pid {running_up.process.pid})\n"
    assert running_up.process.wait(timeout=END_TIMEOUT_S) == 0
    assert all(process_start_ticks(pid) is None for pid in running_up.service_pids)
    assert running_up.process.pid not in [record["pid"] for record in _ps(running_up.environment)]
    again = _stagediff(running_up.environment, "down", port)
    assert again.returncode == 1
    assert again.stderr == f"stagediff down: no running cluster is {port} (`stagediff ps` lists them)\n"


WATCHED = """
import sys, time
from services.supervised import watch_supervisor
watch_supervisor()
print("watching", flush=True)
time.sleep(120)
"""
# A supervisor that starts WATCHED with the death signal only (no pipe), prints its pid and waits to be killed.
PARENT = """
import os, subprocess, sys, time
from services.supervised import SUPERVISOR_PID_ENV
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, SUPERVISOR_PID_ENV: str(os.getpid())},
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "watching\\n"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_watched_service_ends_once_the_supervisors_pipe_closes() -> None:
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", WATCHED],
        env={**os.environ, "STAGEDIFF_SUPERVISOR_FD": str(read)},
        pass_fds=(read,),
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(read)
    try:
        assert child.stdout is not None and child.stdout.readline() == "watching\n"
        assert child.poll() is None
        os.close(write)
        assert child.wait(timeout=END_TIMEOUT_S) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_a_watched_service_ends_by_the_death_signal_once_its_supervisor_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WATCHED], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert process_start_ticks(child_pid) is not None
        parent.kill()
        parent.wait()
        _wait_until(lambda: process_start_ticks(child_pid) is None, "the watched process ended")
    finally:
        parent.kill()
        parent.wait()
