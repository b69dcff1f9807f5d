"""The client commands as a shell runs them, in their own process against an in-process orchestrator whose jobs
run until stopped: Ctrl-C while `generate` follows a job cancels it once and says so in one line, even when
pressed again during the cancel; a reader that goes away (`stagediff info | head`) ends the command quietly."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.orchestrator.servicer import GenerationServicer
from services.orchestrator.tenants import TenantRegistry
from tests.helpers.fake_orchestrator import Orchestrator

CLI = [sys.executable, "-m", "stagediff.cli"]


class HeldCancels:
    """The client's first CancelJob (its SDK's, as the call it interrupted ends) is answered at once; the next (the
    command's own, which reports the job's state) only once `release` is set. `arrived` is set when that one comes."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.count = 0


@pytest.fixture
def held_cancels(monkeypatch) -> HeldCancels:
    held = HeldCancels()
    cancel = GenerationServicer.CancelJob

    async def held_cancel(self, request, context):
        held.count += 1
        if held.count > 1:
            held.arrived.set()
            while not held.release.is_set():
                await asyncio.sleep(0.01)
        return await cancel(self, request, context)

    monkeypatch.setattr(GenerationServicer, "CancelJob", held_cancel)
    return held


@pytest.fixture
def orchestrator(tmp_path: Path, held_cancels: HeldCancels) -> Iterator[Orchestrator]:
    server = Orchestrator(tmp_path / "state", TenantRegistry.open())
    yield server
    held_cancels.release.set()
    server.stop()


class Lines:
    """A stream's lines as they come, read on a thread of their own."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def starting(self, prefix: str) -> str:
        """The next line that starts with `prefix` (those before it are dropped)."""
        while True:
            line = self.lines.get(timeout=60)
            if line.startswith(prefix):
                return line

    def rest(self) -> list[str]:
        """Every line left, once the stream has ended."""
        self.reader.join(timeout=60)
        return list(self.lines.queue)


def test_ctrl_c_cancels_the_job_once_in_one_line_and_a_second_one_does_not_abandon_the_cancel(
    orchestrator: Orchestrator, held_cancels: HeldCancels, tmp_path: Path
) -> None:
    endpoint = f"127.0.0.1:{orchestrator.port}"
    command = [*CLI, "generate", "--endpoint", endpoint, "--prompt", "a fox", "--out", str(tmp_path / "fox.mp4")]
    # SIGINT as on a terminal: a test run that a shell started in the background passes it on ignored.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        lines = Lines(process.stderr)
        job_id = lines.starting("queued job ").split()[2]
        lines.starting("dit: 1/2")  # the job runs
        process.send_signal(signal.SIGINT)
        assert held_cancels.arrived.wait(30), "Ctrl-C did not end in the command's CancelJob"
        process.send_signal(signal.SIGINT)  # while that cancel is under way
        time.sleep(0.2)  # lets the second interrupt reach the client before its cancel can be answered
        held_cancels.release.set()
        assert process.wait(timeout=60) == 130
        rest = lines.rest()
    finally:
        process.kill()
        process.wait()
    assert rest == [f"cancelled job {job_id}"], "one line, no traceback"
    assert process.stdout.read() == "" and held_cancels.count == 2
    assert not (tmp_path / "fox.mp4").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly(orchestrator: Orchestrator) -> None:
    """`stagediff info | head -0`: the command's stdout is a pipe whose reader has gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*CLI, "info", "--endpoint", f"127.0.0.1:{orchestrator.port}"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
