"""Scheduling at the step through running clusters: a job preempted twice (resumed once on the other DiT replica),
a job handed off by a draining DiT, and a request that joins a running continuous batch each give the frames of
their runs alone, to the byte.

The preemption cluster has two DiT replicas (one slot each) and tenants of three classes. The policy itself (who
yields, the bounds, the off switches) is proven by tests/unit/test_preemption_policy.py; the state round trip of
each scheduler by the step-scheduling feature mixin. The tests assert on outcomes and on the job's events, never
on time.
"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff.client import AsyncClient, Client, GenerationResult, Paused, Progress, Resumed, StageDiffError
from stagediff.local.supervisor import LocalCluster
from stagediff.retries import RetryPolicy
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e

# Tens of milliseconds a step: seconds of denoising for the long jobs, a few steps' time for a round trip.
SHAPE = dict(height=256, width=256, num_frames=9, guidance_scale=5.0)
LONG = dict(SHAPE, num_inference_steps=60)
MEDIUM = dict(SHAPE, num_inference_steps=24)
SHORT = dict(SHAPE, num_inference_steps=6)
TENANTS = {"bulk": "low", "standard": "normal", "vip": "high"}
WAIT_S = 120.0


def _tenants_file(directory: Path, keys: dict[str, str]) -> Path:
    path = directory / "tenants.yaml"
    tenants = [
        {"name": name, "api_keys": [hash_api_key(keys[name])], "priority": priority}
        for name, priority in TENANTS.items()
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


@pytest.fixture(scope="module")
def two_dits(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = {name: new_api_key() for name in TENANTS}
    tenants_file = _tenants_file(tmp_path_factory.mktemp("tenants"), keys)
    log_dir = tmp_path_factory.mktemp("step-scheduling-logs")
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=log_dir,
        replicas={"dit": 2},
        extra_args={
            # Jobs of 20 steps or more send their state every 10 steps (for the test of a DiT that dies).
            "orchestrator": ["--tenants", str(tenants_file), "--max-running-jobs", "8", "--checkpoint-every", "10"],
            "dit": ["--drain-grace", "5"],
        },
    )
    cluster.start(timeout=300)
    try:
        yield cluster, keys, log_dir
    finally:
        cluster.stop()


# The long job the preemption, handoff and checkpoint tests follow, and its frames alone (computed once).
LONG_JOB = ("a red circle moves right", dict(LONG, seed=11))


@pytest.fixture(scope="module")
def long_alone(two_dits) -> np.ndarray:
    cluster, keys, _ = two_dits
    return _alone(cluster.endpoint, keys["bulk"], *LONG_JOB)


class Watched:
    """A job followed through its events: its DiT steps, pauses and resumes, and its result."""

    def __init__(self) -> None:
        self.job_id = ""
        self.steps: list[int] = []
        self.step_times: list[float] = []  # when each DiT step was reported (the loop's clock)
        self.paused: list[Paused] = []
        self.resumed: list[Resumed] = []
        self.result: GenerationResult | None = None
        self.changed = asyncio.Event()

    async def follow(self, endpoint: str, key: str, prompt: str, arguments: dict) -> GenerationResult:
        async with AsyncClient(endpoint, api_key=key) as client:
            async for event in client.stream(prompt, **arguments):
                self.job_id = self.job_id or getattr(event, "job_id", "")
                if isinstance(event, Progress) and event.stage == "dit":
                    self.steps.append(event.step)
                    self.step_times.append(asyncio.get_running_loop().time())
                elif isinstance(event, Paused):
                    self.paused.append(event)
                elif isinstance(event, Resumed):
                    self.resumed.append(event)
                elif isinstance(event, GenerationResult):
                    self.result = event
                self.changed.set()
                if self.result is not None:
                    return self.result
        raise AssertionError("the stream ended without a result")

    async def until(self, condition, what: str) -> None:
        async def wait() -> None:
            while not condition():
                self.changed.clear()
                await self.changed.wait()

        try:
            await asyncio.wait_for(wait(), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"job {self.job_id}: {what} did not happen; steps {self.steps[-5:]}") from None


def _alone(endpoint: str, key: str, prompt: str, arguments: dict) -> np.ndarray:
    with Client(endpoint, api_key=key) as client:
        return client.generate(prompt, **arguments).frames


def _dit_endpoints_of(log_dir: Path, job_id: str) -> list[str]:
    """The DiT replicas the orchestrator sent the job's Denoise calls to, in order (its log says each)."""
    log = (log_dir / "orchestrator.log").read_text()
    return re.findall(rf"job {job_id}: denoising on (\S+) from step", log)


def test_a_job_preempted_twice_and_resumed_on_the_other_replica_keeps_its_frames(two_dits, long_alone) -> None:
    cluster, keys, log_dir = two_dits
    endpoint = cluster.endpoint
    prompt, low = LONG_JOB
    reference = long_alone

    async def scenario() -> tuple[Watched, list[Watched]]:
        victim, first, second, high = Watched(), Watched(), Watched(), Watched()
        tasks = [asyncio.create_task(victim.follow(endpoint, keys["bulk"], prompt, low))]
        await victim.until(lambda: len(victim.steps) >= 3, "the low job's first steps")
        # A normal job takes the other replica; a second one finds both busy and the low job yields to it.
        tasks.append(
            asyncio.create_task(first.follow(endpoint, keys["standard"], "a blue square", dict(MEDIUM, seed=12)))
        )
        await first.until(lambda: len(first.steps) >= 1, "the first normal job's first step")
        tasks.append(asyncio.create_task(second.follow(endpoint, keys["standard"], "a triangle", dict(LONG, seed=13))))
        await victim.until(lambda: len(victim.paused) == 1, "the first preemption")
        # The first normal job (the shorter) ends long before the second: the low job resumes on its replica, then
        # yields again to a high job while the second still runs.
        await victim.until(lambda: len(victim.resumed) == 1 and len(victim.steps) > victim.paused[0].step + 2, "resume")
        tasks.append(asyncio.create_task(high.follow(endpoint, keys["vip"], "a green star", dict(SHORT, seed=14))))
        await asyncio.gather(*tasks)
        return victim, [first, second, high]

    victim, others = asyncio.run(scenario())
    assert victim.result is not None
    assert [pause.reason for pause in victim.paused] == ["preempted", "preempted"]
    assert [pause.preemptions for pause in victim.paused] == [1, 2]
    # It resumed where it paused: each step ran once.
    assert [resume.step for resume in victim.resumed] == [pause.step for pause in victim.paused]
    assert sorted(victim.steps) == list(range(1, LONG["num_inference_steps"] + 1))
    calls = _dit_endpoints_of(log_dir, victim.job_id)
    print(f"the low job's calls: {calls}; paused at {[p.step for p in victim.paused]}")
    assert len(calls) == 3 and calls[1] != calls[0], f"resumed on the replica it left: {calls}"
    np.testing.assert_array_equal(victim.result.frames, reference)
    with Client(endpoint, api_key=keys["bulk"]) as client:
        assert client.get_job(victim.job_id).preemptions == 2
    assert all(other.result is not None and not other.paused for other in others)


async def _stop_its_replica(cluster: LocalCluster, key: str, log_dir: Path, after_steps: int, signum: int) -> Watched:
    """The long job, its DiT replica sent `signum` once it has reported `after_steps` steps, followed to its end."""
    job = Watched()
    task = asyncio.create_task(job.follow(cluster.endpoint, key, *LONG_JOB))
    await job.until(lambda: len(job.steps) >= after_steps, f"the job's first {after_steps} steps")
    running_on = _dit_endpoints_of(log_dir, job.job_id)[-1]
    cluster.kill(next(name for name, service in cluster.services.items() if service.endpoint == running_on), signum)
    await task
    return job


def test_a_draining_dit_hands_its_job_off_without_repeating_steps(two_dits, long_alone) -> None:
    cluster, keys, log_dir = two_dits
    reference = long_alone

    job = asyncio.run(_stop_its_replica(cluster, keys["bulk"], log_dir, after_steps=5, signum=signal.SIGTERM))
    assert [pause.reason for pause in job.paused] == ["handoff"]
    assert job.result is not None
    np.testing.assert_array_equal(job.result.frames, reference)
    # The DiTs' step counter: every step once, at most one run again.
    total = LONG["num_inference_steps"]
    assert set(job.steps) == set(range(1, total + 1)) and len(job.steps) <= total + 1, job.steps
    calls = _dit_endpoints_of(log_dir, job.job_id)
    assert len(calls) == 2 and calls[0] != calls[1]
    cluster.restart(next(name for name, service in cluster.services.items() if service.endpoint == calls[0]))


def test_a_dit_that_dies_costs_its_job_the_steps_since_its_last_checkpoint(two_dits, long_alone) -> None:
    cluster, keys, log_dir = two_dits
    reference = long_alone

    # Jobs of 20 steps or more send their state every 10 steps: killed after step 25, it resumes from 20 or later.
    job = asyncio.run(_stop_its_replica(cluster, keys["bulk"], log_dir, after_steps=25, signum=signal.SIGKILL))
    assert job.result is not None and not job.paused
    np.testing.assert_array_equal(job.result.frames, reference)
    total = LONG["num_inference_steps"]
    resumed_from = [resume.step for resume in job.resumed]
    assert len(resumed_from) == 1 and resumed_from[0] % 10 == 0 and resumed_from[0] >= 20, resumed_from
    # Steps after the last checkpoint ran twice: fewer than 10 (and every step at least once).
    assert set(job.steps) == set(range(1, total + 1)) and len(job.steps) - total < 10, job.steps
    print(f"resumed from step {resumed_from[0]}: {len(job.steps) - total} steps ran twice")


def test_a_deadline_that_cannot_be_met_is_refused_at_once_with_the_estimate(two_dits) -> None:
    cluster, keys, _ = two_dits
    # The DiTs' step times for this shape are known from the tests before.
    with Client(cluster.endpoint, api_key=keys["vip"], retry=RetryPolicy(rate_limit_retries=0)) as client:
        with pytest.raises(StageDiffError) as refused:
            client.submit("a slow fox", **LONG, deadline_s=0.2)
        with pytest.raises(StageDiffError) as invalid:
            client.submit("a fox", **SHORT, deadline_s=-1)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "deadline_s" in refused.value.message and "would finish in about" in refused.value.message
    assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT and "deadline_s" in invalid.value.message


@pytest.fixture(scope="module")
def continuous(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("continuous-logs"),
        extra_args={"dit": ["--max-batch-size", "2", "--continuous-batching"]},
    )
    cluster.start(timeout=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_request_joins_a_running_continuous_batch_and_keeps_its_frames(continuous) -> None:
    endpoint = continuous.endpoint
    first_request = dict(SHAPE, num_inference_steps=30, seed=31)
    joining_request = dict(SHAPE, num_inference_steps=12, seed=32, guidance_scale=4.0)
    first_alone = _alone(endpoint, "", "a red circle", first_request)
    joining_alone = _alone(endpoint, "", "a blue square", joining_request)

    async def scenario() -> tuple[Watched, Watched]:
        first, joining = Watched(), Watched()
        task = asyncio.create_task(first.follow(endpoint, "", "a red circle", first_request))
        await first.until(lambda: len(first.steps) >= 7, "the first request's seventh step")
        await joining.follow(endpoint, "", "a blue square", joining_request)
        await task
        return first, joining

    first, joining = asyncio.run(scenario())
    # It joined the running batch: all of its steps ran before the first request's last one.
    assert joining.steps == list(range(1, 13))
    assert joining.step_times[-1] < first.step_times[-1]
    assert first.steps[-1] == 30 and len(first.steps) == 30
    assert first.result is not None and joining.result is not None
    np.testing.assert_array_equal(first.result.frames, first_alone)
    np.testing.assert_array_equal(joining.result.frames, joining_alone)
