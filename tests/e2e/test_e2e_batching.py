"""Request batching through a running cluster (`--max-batch-size`): concurrent requests of two tenants are
denoised as one batch, each gets the frames of its own run and its own progress, and cancelling one request
of a batch stops it alone while the others finish with their own frames."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff.client import AsyncClient, Client, GenerationResult, Progress, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.serving import THREADS_PER_STAGE

TENANTS = ("acme", "globex")
CASE = dict(height=48, width=80, num_frames=5, num_inference_steps=6, guidance_scale=4.0)
# Three requests a batch may mix: other prompts, seeds and guidance scales.
REQUESTS = [
    ("acme", "a red circle moves right", {"seed": 1}),
    ("globex", "a blue square moves left", {"seed": 2, "guidance_scale": 5.5}),
    ("acme", "a green triangle", {"seed": 3, "negative_prompt": "blurry"}),
]


@pytest.fixture(scope="module")
def batching_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = {name: new_api_key() for name in TENANTS}
    tenants_file = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants_file.write_text(
        yaml.safe_dump({"tenants": [{"name": name, "api_keys": [hash_api_key(keys[name])]} for name in TENANTS]})
    )
    log_dir = tmp_path_factory.mktemp("batching-logs")
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=log_dir,
        extra_args={
            # Tenants share a batch only where the operator lets them (by default each batch is one tenant's).
            "orchestrator": ["--tenants", str(tenants_file), "--no-batch-per-tenant"],
            # A long wait, so that the three requests of a test always meet in one batch.
            "dit": ["--max-batch-size", "3", "--batch-wait-ms", "5000"],
        },
    )
    cluster.start(timeout=300)
    try:
        yield cluster, keys, log_dir
    finally:
        cluster.stop()


async def _generate(endpoint: str, key: str, prompt: str, arguments: dict, progress: list, cancel_after: int = 0):
    """The request's result; with `cancel_after`, cancels its job once that many DiT steps are reported."""
    async with AsyncClient(endpoint, api_key=key) as client:
        async for event in client.stream(prompt, **{**CASE, **arguments}):
            if isinstance(event, GenerationResult):
                return event
            if isinstance(event, Progress) and event.stage == "dit":
                progress.append(event.step)
                if cancel_after and event.step == cancel_after:
                    await client.cancel(event.job_id)
    raise AssertionError("the stream ended without a result")


def _alone(endpoint: str, key: str, prompt: str, arguments: dict) -> np.ndarray:
    with Client(endpoint, api_key=key) as client:
        return client.generate(prompt, **{**CASE, **arguments}).frames


def _batches_in(log_dir: Path) -> list[str]:
    return [line for path in log_dir.glob("dit*.log") for line in path.read_text().splitlines() if "a batch of" in line]


def test_concurrent_requests_of_two_tenants_share_a_batch_and_keep_their_frames(batching_cluster) -> None:
    cluster, keys, log_dir = batching_cluster
    progress: list[list[int]] = [[] for _ in REQUESTS]

    async def together():
        return await asyncio.gather(
            *(
                _generate(cluster.endpoint, keys[tenant], prompt, arguments, progress[index])
                for index, (tenant, prompt, arguments) in enumerate(REQUESTS)
            )
        )

    before = len(_batches_in(log_dir))
    results = asyncio.run(together())
    assert any("a batch of 3 requests" in line for line in _batches_in(log_dir)[before:]), _batches_in(log_dir)
    for index, (tenant, prompt, arguments) in enumerate(REQUESTS):
        alone = _alone(cluster.endpoint, keys[tenant], prompt, arguments)
        difference = np.abs(results[index].frames.astype(np.int16) - alone.astype(np.int16)).max()
        assert difference <= 1, (index, difference)
        # Each request's own progress, every step once.
        assert progress[index] == list(range(1, CASE["num_inference_steps"] + 1)), progress[index]


def test_cancelling_one_request_of_a_batch_stops_only_it(batching_cluster) -> None:
    cluster, keys, log_dir = batching_cluster
    progress: list[list[int]] = [[] for _ in REQUESTS]
    cancel_after = [0, 2, 0]  # the second request, of the other tenant, is cancelled after its second step
    # Many steps, so that the cancel's trip (the step's event to the client, its cancel back to the DiT) ends
    # long before the last step however loaded the machine is; that a dropped row leaves at the next step
    # boundary is proven without the clock by the batching mixin (tests/helpers/feature_mixins/batching.py).
    steps = {"num_inference_steps": 30}

    async def together():
        return await asyncio.gather(
            *(
                _generate(
                    cluster.endpoint, keys[tenant], prompt, {**arguments, **steps}, progress[index], cancel_after[index]
                )
                for index, (tenant, prompt, arguments) in enumerate(REQUESTS)
            ),
            return_exceptions=True,
        )

    before = len(_batches_in(log_dir))
    results = asyncio.run(together())
    assert any("a batch of 3 requests" in line for line in _batches_in(log_dir)[before:])
    cancelled = results[1]
    assert isinstance(cancelled, StageDiffError) and cancelled.code == grpc.StatusCode.CANCELLED, cancelled
    # Stopped after the cancel, long before its last step; the others ran every step.
    assert progress[1] == list(range(1, len(progress[1]) + 1)) and 2 <= len(progress[1]) < 30, progress[1]
    for index in (0, 2):
        tenant, prompt, arguments = REQUESTS[index]
        alone = _alone(cluster.endpoint, keys[tenant], prompt, {**arguments, **steps})
        assert np.abs(results[index].frames.astype(np.int16) - alone.astype(np.int16)).max() <= 1, index
        assert progress[index] == list(range(1, 31))
