"""The orchestrator runs the served family's chain with the stages it has endpoints for, and relays bytes.

Fake stages (text encoder, DiT, VAE) serve on 127.0.0.1 from the test's event loop and record what they
receive; the orchestrator's own GenerationServicer, Pipeline, JobManager and StagePool run against them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.fake_stages import FakeStages, generate_request, refusal

REPO = Path(__file__).resolve().parents[2]


def test_the_orchestrator_never_imports_torch() -> None:
    """Importing the orchestrator's service (and everything it imports) leaves torch out of the process."""
    script = (
        "import sys\n"
        "import services.orchestrator.service\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers'))\n"
        "print(' '.join(heavy))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"the orchestrator imported {run.stdout.strip()}"


def test_the_served_orchestrator_stays_not_serving_without_a_stage_its_chain_needs(tmp_path: Path) -> None:
    """`stagediff serve orchestrator` without --vae: health NOT_SERVING, the reason logged, Generate refused."""

    async def scenario() -> None:
        stages = await FakeStages().start()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.orchestrator.service",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--text-encoder",
            stages.endpoints["text-encoder"],
            "--dit",
            stages.endpoints["dit"],
            "--state-dir",
            str(tmp_path / "state"),
            "--health-interval",
            "0.1",
            cwd=REPO,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        log: list[str] = []
        try:
            endpoint = None
            while not log or "health stays NOT_SERVING" not in log[-1]:
                try:
                    line = await asyncio.wait_for(process.stderr.readline(), timeout=120)
                except TimeoutError:
                    pytest.fail("the orchestrator never said why it is not serving:\n" + "".join(log))
                assert line, "the orchestrator exited:\n" + "".join(log)
                log.append(line.decode())
                if " listening on " in log[-1]:
                    endpoint = log[-1].rsplit(" listening on ", 1)[1].split()[0]
            assert "no endpoint for vae: start it with --vae HOST:PORT" in log[-1]
            async with grpc.aio.insecure_channel(endpoint) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            error = await refusal(endpoint, generate_request())
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "--vae" in error.details(), error
        finally:
            process.terminate()
            await process.wait()
            await stages.stop()

    asyncio.run(scenario())
