"""A stage told to stop (SIGTERM) drains (services/server.py, --drain-grace): health turns NOT_SERVING, it takes
no new call, and its calls in flight run on for the grace before they are cut.

The DiT being drained is a fake one behind the real server code, in a process of its own
(tests/helpers/draining_dit.py), first in the orchestrator's list so that the job's call goes to it; a second
fake DiT serves beside it. The orchestrator's stage pool, pipeline and jobs are the real ones, in this process,
and may retry no stage call (`stage_retries=0`): a cut call can only move to the other DiT, as a failover.
- A grace longer than the call: the call finishes where it runs; the job succeeds and no call moved.
- A grace shorter than the call: the call is cut when the grace ends and fails over; the job succeeds with the
  same frames.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.metrics import OrchestratorMetrics
from services.orchestrator.job import JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobStore
from services.orchestrator.tenants import Tenant
from stagediff.local.launch import free_ports
from stagediff.tensor_codec import TensorAssembler
from tests.helpers.client_only import REPOSITORY
from tests.helpers.fake_stages import MODEL, FakeDenoiser, FakeTextEncoder, FakeVae, generate_request, serve_stage

HOST = "127.0.0.1"
# The frames of the fake stages' 9-frame result: (first frame, count, value), as the VAE sends its pieces.
FRAMES = [(0, 1, 0), (1, 4, 1), (5, 4, 2)]


@pytest.mark.parametrize(
    ("grace_s", "hold_s", "failovers"),
    [(10.0, 1.0, 0), (0.3, 60.0, 1)],
    ids=["grace-longer-than-the-call", "grace-shorter-than-the-call"],
)
def test_a_dit_told_to_stop_finishes_its_call_within_its_grace(
    tmp_path: Path, grace_s: float, hold_s: float, failovers: int
) -> None:
    draining_port, other_port = free_ports(2, HOST)
    log = (tmp_path / "dit.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.draining_dit", str(draining_port), str(grace_s), str(hold_s)],
        cwd=REPOSITORY,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        frames, moved = asyncio.run(_job_through_a_drain(tmp_path, process, draining_port, other_port))
        assert process.wait(timeout=30) == 0, (tmp_path / "dit.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert frames == FRAMES
    assert moved == failovers, (tmp_path / "dit.log").read_text()
    assert "draining" in (tmp_path / "dit.log").read_text()


async def _job_through_a_drain(
    tmp_path: Path, process: subprocess.Popen[bytes], draining_port: int, other_port: int
) -> tuple[list[tuple[int, int, int]], int]:
    """Runs one job and SIGTERMs the DiT it runs on at its first step. Returns the job's frames as (first,
    count, value) and how many DiT calls failed over."""
    text_encoder, text_encoder_endpoint = await serve_stage("text-encoder", FakeTextEncoder())
    vae, vae_endpoint = await serve_stage("vae", FakeVae())
    other, _ = await serve_stage("dit", FakeDenoiser(), port=other_port)
    servers = [text_encoder, vae, other]
    metrics = OrchestratorMetrics()
    endpoints = {
        "text-encoder": text_encoder_endpoint,
        "dit": [f"{HOST}:{draining_port}", f"{HOST}:{other_port}"],
        "vae": vae_endpoint,
    }
    pool = StagePool(endpoints, probe_interval_s=0.1, metrics=metrics)
    pool.start_probing()
    store = JobStore.open(tmp_path / "state")
    jobs = JobManager(
        Pipeline(pool, stage_retries=0, retry_backoff_s=0.01, store=store, metrics=metrics).run, FairScheduler(), store
    )
    try:
        async with asyncio.timeout(60):  # the draining DiT's process is starting
            while len(pool["dit"].serving()) < 2:
                await asyncio.sleep(0.05)
        job, _ = await jobs.submit(generate_request(model=MODEL), Tenant(name="default"))
        assembler, frames, stopped = TensorAssembler(), [], False
        async for event in job.follow():
            if event.HasField("progress") and event.progress.stage == "dit" and not stopped:
                process.send_signal(signal.SIGTERM)
                stopped = True
            if event.HasField("result") and (tensor := assembler.feed(event.result.tensor)) is not None:
                frames.append((tensor.index, tensor.array.shape[0], int(tensor.array[0, 0, 0, 0])))
        assert job.state == JobState.JOB_STATE_SUCCEEDED, job.error_message
        draining, _ = pool["dit"].replicas
        assert draining.endpoint == f"{HOST}:{draining_port}" and draining.calls == 1, "the call ran elsewhere"
        assert job.task is not None
        await asyncio.wait([job.task])  # its bookkeeping after the last event, before the store closes
        moved = sum(
            sample.value
            for metric in metrics.registry.collect()
            for sample in metric.samples
            if sample.name == "stagediff_stage_failovers_total" and sample.labels["stage"] == "dit"
        )
        return frames, int(moved)
    finally:
        await jobs.shutdown()
        await pool.close()
        store.close()
        for server in servers:
            await server.stop(None)
