"""Acceptance tests for durability under real faults: nothing accepted is lost, nothing runs twice.

1. Under a load from three tenants, one DiT replica and one VAE replica are SIGKILLed while they
   have calls in flight: every job still completes with exactly the frames a fault-free run of the
   same request makes, each frame arrives once, every tenant lists exactly its jobs, and the killed
   replicas, restarted, rejoin the rotation and take calls again. The orchestrator may retry no stage
   call (`--stage-retries 0`): the cut calls move to the other replica as failovers, which are free.
2. The orchestrator is SIGKILLed with jobs queued, running and finished, and restarted on the same
   port and state directory: every accepted job completes with the fault-free frames, finished
   results replay as they were first received, and a resubmitted request id returns its job.

Times are printed, never asserted; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff.client import AsyncClient, FramesReceived, GenerationResult, Progress, Queued, RetryPolicy
from stagediff.local.launch import free_ports
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e

SUCCEEDED = generation_pb2.JobState.JOB_STATE_SUCCEEDED
QUEUED = generation_pb2.JobState.JOB_STATE_QUEUED
RUNNING = generation_pb2.JobState.JOB_STATE_RUNNING

# Bounds on waiting; never asserted as durations.
SETTLE_S = 60.0
CALL_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 300.0

TENANTS = {"alpha": "high", "beta": "normal", "gamma": "low"}  # name -> priority class


@dataclass(frozen=True)
class Spec:
    """One generation request: who sends it and what it asks for."""

    tenant: str
    prompt: str
    seed: int
    num_frames: int
    steps: int
    height: int = 32
    width: int = 32

    def arguments(self) -> dict[str, object]:
        return dict(
            seed=self.seed,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            num_inference_steps=self.steps,
            guidance_scale=1.0,  # no CFG: one prompt per job, the smallest work
        )


@dataclass
class Outcome:
    job_id: str
    frames: np.ndarray
    pieces: list[tuple[int, int]]  # (first frame, count) of each frame tensor, as received
    events: list[object] = field(default_factory=list)  # the SDK's typed events, in order


def restarted_after_frames(outcome: Outcome) -> tuple[bool, bool]:
    """(whether the job was run again in some stage, whether that happened after frames had arrived).

    A stage run again reports its progress from the start again, so a repeated (stage, step) marks a retry.
    """
    seen: set[tuple[str, int]] = set()
    frames = 0
    for event in outcome.events:
        if isinstance(event, FramesReceived):
            frames += event.count
        elif isinstance(event, Progress):
            if (event.stage, event.step) in seen:
                return True, frames > 0
            seen.add((event.stage, event.step))
    return False, False


def write_tenants(path: Path, names: dict[str, str]) -> dict[str, str]:
    """A tenants file with one fresh key per tenant; returns the keys by tenant."""
    keys = {name: new_api_key() for name in names}
    document = {
        "tenants": [
            # The first tenant is the operator's: it reads the cluster's replicas with GetClusterInfo.
            {"name": name, "api_keys": [hash_api_key(keys[name])], "priority": priority, "admin": index == 0}
            for index, (name, priority) in enumerate(names.items())
        ]
    }
    path.write_text(yaml.safe_dump(document))
    return keys


def start_cluster(model: Path, log_dir: Path, **options) -> LocalCluster:
    cluster = LocalCluster(model, threads_per_stage=THREADS_PER_STAGE, log_dir=log_dir, **options)
    cluster.start(timeout=STARTUP_TIMEOUT_S)
    return cluster


def assert_frames_once(outcome: Outcome, spec: Spec) -> None:
    """Every frame arrived exactly once, in order, and the result holds the frames asked for."""
    starts = [first for first, _ in outcome.pieces]
    assert starts == sorted(set(starts)), f"job {outcome.job_id}: frames sent twice or out of order: {outcome.pieces}"
    assert sum(count for _, count in outcome.pieces) == spec.num_frames, outcome.pieces
    assert outcome.frames.shape == (spec.num_frames, spec.height, spec.width, 3)


async def generate(client: AsyncClient, spec: Spec, request_id: str, on_event=None) -> Outcome:
    """Runs one job through Generate and keeps what arrived; `on_event` sees every event."""
    pieces: list[tuple[int, int]] = []
    events: list[object] = []
    async for event in client.stream(spec.prompt, request_id=request_id, **spec.arguments()):
        if on_event is not None:
            on_event(event)
        events.append(event)
        if isinstance(event, FramesReceived):
            pieces.append((event.first_frame, event.count))
        elif isinstance(event, GenerationResult):
            return Outcome(event.job_id, event.frames, pieces, events)
    raise AssertionError(f"{request_id}: the stream ended without a result")


async def watch(client: AsyncClient, job_id: str) -> Outcome:
    """Follows (or replays) a job through WatchJob."""
    pieces: list[tuple[int, int]] = []

    def on_event(event: object) -> None:
        if isinstance(event, FramesReceived):
            pieces.append((event.first_frame, event.count))

    result = await client.wait(job_id, on_progress=on_event)
    return Outcome(result.job_id, result.frames, pieces)


async def eventually(check, what: str, timeout: float = SETTLE_S):
    """Polls an async check until it returns something truthy; fails after `timeout`."""
    give_up_at = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < give_up_at, f"never happened within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.05)


def replicas_of(info: generation_pb2.ClusterInfo) -> dict[str, generation_pb2.ReplicaStatus]:
    return {replica.endpoint: replica for stage in info.stages for replica in stage.replicas}


async def assert_listed_exactly(
    client: AsyncClient, tenant: str, expected: dict[str, Spec]
) -> list[generation_pb2.Job]:
    """The tenant's ListJobs holds one job per expected request id, no other, each SUCCEEDED."""
    jobs = await client.list_jobs(limit=1000)
    listed = [job.request.request_id for job in jobs]
    assert sorted(listed) == sorted(expected), f"{tenant}: listed {sorted(listed)}, submitted {sorted(expected)}"
    for job in jobs:
        spec = expected[job.request.request_id]
        assert job.state == SUCCEEDED, f"{tenant} {job.request.request_id}: {generation_pb2.JobState.Name(job.state)}"
        assert job.num_frames_out == spec.num_frames
        assert (job.request.prompt, job.request.seed) == (spec.prompt, spec.seed)
    return jobs


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The orchestrator's Prometheus samples: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# -- 1. replicas SIGKILLed under a multi-tenant load ---------------------------------------------

# The load: 8 jobs per tenant at once, then 2 per tenant once the killed replicas serve again. First in
# line, two jobs per tenant that denoise longer and make more frames: the DiT replica is killed while they
# denoise, with at least STEPS_AHEAD steps to go, so its calls cannot end before the kill.
LONG_STEPS = 120
STEPS_AHEAD = 60
FIRST_WAVE = [
    Spec(tenant, f"{tenant} long take {i}", seed=100 + 10 * n + i, num_frames=17, steps=LONG_STEPS, height=64, width=64)
    if i < 2
    else Spec(tenant, f"{tenant} lighthouse {i}", seed=100 + 10 * n + i, num_frames=(1, 5)[i % 2], steps=1 + i % 2)
    for i in range(8)
    for n, tenant in enumerate(TENANTS)
]
SECOND_WAVE = [
    Spec(tenant, f"{tenant} harbour {i}", seed=200 + 10 * n + i, num_frames=(5, 1)[i % 2], steps=2 - i % 2)
    for n, tenant in enumerate(TENANTS)
    for i in range(2)
]


def test_replicas_killed_under_a_multi_tenant_load_lose_no_job_and_rejoin(tiny_model, tmp_path) -> None:
    assert len(FIRST_WAVE) >= 20
    keys = write_tenants(tmp_path / "tenants.yaml", TENANTS)
    (metrics_port,) = free_ports(1, "127.0.0.1")
    cluster = start_cluster(
        tiny_model,
        tmp_path / "logs",
        replicas={"dit": 2, "vae": 2},
        extra_args={
            "orchestrator": [
                "--tenants", str(tmp_path / "tenants.yaml"),
                "--stage-retries", "0",
                "--health-interval", "0.2",
                "--metrics-port", str(metrics_port),
            ]
        },
    )  # fmt: skip
    try:
        asyncio.run(_load_with_replica_kills(cluster, keys, metrics_port))
    finally:
        cluster.stop()


async def _load_with_replica_kills(cluster: LocalCluster, keys: dict[str, str], metrics_port: int) -> None:
    assert cluster.replicas("dit") == ["dit", "dit-2"] and cluster.replicas("vae") == ["vae", "vae-2"]
    endpoint_of = {name: cluster.services[name].endpoint for name in cluster.services}
    clients = {
        tenant: AsyncClient(cluster.endpoint, api_key=key, timeout=CALL_TIMEOUT_S) for tenant, key in keys.items()
    }
    admin = clients["alpha"]
    specs = FIRST_WAVE + SECOND_WAVE
    try:
        # The same requests without faults, on the same cluster: what every job must produce.
        started = time.monotonic()
        references = await asyncio.gather(
            *(generate(clients[spec.tenant], spec, f"reference-{i}") for i, spec in enumerate(specs))
        )
        print(f"\nfault-free run: {len(specs)} jobs from {len(clients)} tenants in {time.monotonic() - started:.1f} s")
        for spec, reference in zip(specs, references, strict=True):
            assert_frames_once(reference, spec)

        # The load. A DiT replica is SIGKILLed while the first jobs denoise, a VAE replica once some job has
        # part of its frames: each the busiest of its stage, with calls in flight.
        started = time.monotonic()
        denoising, part_sent = asyncio.Event(), asyncio.Event()

        def note_progress(spec: Spec):
            def on_event(event: object) -> None:
                if isinstance(event, Progress) and event.stage == "dit" and spec.steps - event.step >= STEPS_AHEAD:
                    denoising.set()
                if isinstance(event, FramesReceived) and event.first_frame + event.count < spec.num_frames:
                    part_sent.set()

            return on_event

        first_wave = [
            asyncio.create_task(generate(clients[spec.tenant], spec, f"load-{i}", note_progress(spec)))
            for i, spec in enumerate(FIRST_WAVE)
        ]

        async def kill_busiest(stage: str, moment: asyncio.Event) -> tuple[str, int]:
            waiting = asyncio.create_task(moment.wait())
            load_ended = asyncio.create_task(asyncio.wait(first_wave))
            await asyncio.wait({waiting, load_ended}, timeout=SETTLE_S, return_when=asyncio.FIRST_COMPLETED)
            load_ended.cancel()
            assert moment.is_set(), f"the moment to kill a {stage} replica never came"

            async def busiest() -> tuple[str, int] | None:
                assert not all(task.done() for task in first_wave), f"the load ended before a {stage} replica was busy"
                served = replicas_of(await admin.cluster_info())
                name = max(cluster.replicas(stage), key=lambda n: served[endpoint_of[n]].in_flight)
                in_flight = served[endpoint_of[name]].in_flight
                return (name, in_flight) if in_flight > 0 else None

            name, in_flight = await eventually(busiest, f"a {stage} replica with calls in flight")
            await asyncio.to_thread(cluster.kill, name)  # SIGKILL
            unfinished = sum(not task.done() for task in first_wave)
            print(
                f"SIGKILLed {name} with {in_flight} call(s) in flight, {time.monotonic() - started:.2f} s into the "
                f"load, {unfinished} of {len(FIRST_WAVE)} jobs unfinished"
            )
            return name, in_flight

        victims = dict(
            zip(
                ("dit", "vae"),
                await asyncio.gather(kill_busiest("dit", denoising), kill_busiest("vae", part_sent)),
                strict=True,
            )
        )

        # Restarted, on the same ports, while the survivors carry the load.
        restarting = time.monotonic()
        await asyncio.gather(*(asyncio.to_thread(cluster.restart, name) for name, _ in victims.values()))
        restarted = [endpoint_of[name] for name, _ in victims.values()]

        async def all_serving() -> dict[str, generation_pb2.ReplicaStatus] | None:
            served = replicas_of(await admin.cluster_info())
            return served if all(replica.health == "SERVING" for replica in served.values()) else None

        served = await eventually(all_serving, "every replica, the restarted ones too, SERVING in GetClusterInfo")
        calls_at_rejoin = {endpoint: served[endpoint].calls for endpoint in restarted}
        print(f"killed replicas restarted and back in rotation {time.monotonic() - restarting:.1f} s after the kills")

        # More work from every tenant, which the rejoined replicas share.
        second_wave = [
            asyncio.create_task(generate(clients[spec.tenant], spec, f"load-{len(FIRST_WAVE) + i}"))
            for i, spec in enumerate(SECOND_WAVE)
        ]
        outcomes = await asyncio.gather(*first_wave, *second_wave)
        print(f"faulty run: {len(outcomes)} jobs in {time.monotonic() - started:.1f} s")

        for i, (spec, outcome, reference) in enumerate(zip(specs, outcomes, references, strict=True)):
            assert_frames_once(outcome, spec)
            assert np.array_equal(outcome.frames, reference.frames), f"load-{i} ({spec}): frames differ"
        # Which replica a job lands on is the pool's choice, so whether a cut job had already sent frames
        # varies from run to run: measured, not required.
        restarts = [restarted_after_frames(outcome) for outcome in outcomes]
        print(
            f"{sum(again for again, _ in restarts)} job(s) reported a stage's progress twice (ran it again), "
            f"{sum(after for _, after in restarts)} of them after some of their frames had arrived"
        )
        job_ids = [outcome.job_id for outcome in (*references, *outcomes)]
        assert len(set(job_ids)) == len(job_ids), "two requests shared a job"

        # No job lost or duplicated: each tenant lists exactly its requests, once each, all SUCCEEDED.
        for tenant, client in clients.items():
            expected = {
                f"{kind}-{i}": spec
                for kind in ("reference", "load")
                for i, spec in enumerate(specs)
                if spec.tenant == tenant
            }
            listed = await assert_listed_exactly(client, tenant, expected)
            assert {job.job_id for job in listed} <= set(job_ids)

        served = replicas_of(await admin.cluster_info())
        for endpoint in restarted:
            assert served[endpoint].health == "SERVING"
            assert served[endpoint].calls > calls_at_rejoin[endpoint], f"restarted {endpoint} took no call"
        print(
            "calls of the restarted replicas at rejoin -> end: "
            + ", ".join(f"{e}: {calls_at_rejoin[e]} -> {served[e].calls}" for e in restarted)
        )

        # The kills cut real calls: the orchestrator saw calls to each killed replica fail UNAVAILABLE.
        samples = await asyncio.to_thread(scrape, metrics_port)
        for stage, (name, _) in victims.items():
            cut = metric(
                samples, "stagediff_stage_calls_total", stage=stage, replica=endpoint_of[name], grpc_code="UNAVAILABLE"
            )
            failovers = metric(samples, "stagediff_stage_failovers_total", stage=stage, replica=endpoint_of[name])
            retries = metric(samples, "stagediff_stage_retries_total", stage=stage)
            print(f"{stage}: {cut:.0f} call(s) to {name} cut, {failovers:.0f} failover(s), {retries:.0f} retry(ies)")
            assert cut > 0, f"no call to the killed {name} failed: the kill cut nothing"
            assert failovers > 0 and retries == 0, f"{stage}: the cut calls were not failed over for free"
    finally:
        for client in clients.values():
            await client.close()


# -- 2. the orchestrator SIGKILLed with jobs queued, running and finished ------------------------

SLOW_STEPS = 1000  # seconds of denoising on the tiny model: long enough to be killed mid-way
RESTART_TENANTS = {"north": "normal", "south": "normal"}
RESTART_SPECS = {
    "slow": Spec("north", "a slow pan over dunes", seed=31, num_frames=1, steps=SLOW_STEPS),
    "quick-a": Spec("south", "a quick cut", seed=32, num_frames=5, steps=2),
    "quick-b": Spec("north", "another quick cut", seed=33, num_frames=5, steps=1),
    "quick-c": Spec("south", "a still", seed=34, num_frames=1, steps=2),
}


# The clients live through the restart: their retries on UNAVAILABLE outlast the orchestrator's downtime.
RESTART_RETRY = RetryPolicy(max_attempts=20, initial_backoff_s=0.25, max_backoff_s=2.0)


def test_orchestrator_killed_with_jobs_queued_running_and_finished_loses_none(tiny_model, tmp_path) -> None:
    keys = write_tenants(tmp_path / "tenants.yaml", RESTART_TENANTS)
    cluster = start_cluster(
        tiny_model,
        tmp_path / "logs",
        state_dir=tmp_path / "state",
        extra_args={
            "orchestrator": [
                "--tenants", str(tmp_path / "tenants.yaml"),
                "--max-running-jobs", "1",
                "--health-interval", "0.2",
                # The kill comes right after the slow job's first DiT step: its conditioning is stored by then.
                "--keep-outputs-after", "0",
            ]
        },
    )  # fmt: skip
    try:
        asyncio.run(_restart_with_jobs_in_every_state(cluster, keys))
    finally:
        cluster.stop()


async def _restart_with_jobs_in_every_state(cluster: LocalCluster, keys: dict[str, str]) -> None:
    specs = RESTART_SPECS
    clients = {
        tenant: AsyncClient(cluster.endpoint, api_key=key, timeout=CALL_TIMEOUT_S, retry=RESTART_RETRY)
        for tenant, key in keys.items()
    }
    try:
        # Fault-free references, one after another; these are the finished jobs when the orchestrator dies.
        references: dict[str, Outcome] = {}
        for name, spec in specs.items():
            job = await clients[spec.tenant].submit(spec.prompt, request_id=f"reference-{name}", **spec.arguments())
            references[name] = await watch(clients[spec.tenant], job.job_id)
            assert_frames_once(references[name], spec)

        # The same requests again. The slow one streams through Generate, connected across the kill...
        slow = specs["slow"]
        submitted: dict[str, str] = {}
        steps_seen: list[int] = []
        denoising = asyncio.Event()

        def on_slow_event(event: object) -> None:
            if isinstance(event, Queued):
                submitted.setdefault("slow", event.job_id)
            if isinstance(event, Progress) and event.stage == "dit":
                steps_seen.append(event.step)
                denoising.set()

        streaming = asyncio.create_task(generate(clients[slow.tenant], slow, "run-slow", on_slow_event))
        started = asyncio.create_task(denoising.wait())
        await asyncio.wait({started, streaming}, timeout=SETTLE_S, return_when=asyncio.FIRST_COMPLETED)
        if streaming.done():
            streaming.result()  # raises what ended the stream early
        assert started.done(), "the slow job never started denoising"
        # ... and, since one job runs at a time, the quick ones queue behind it.
        for name, spec in specs.items():
            if name != "slow":
                job = await clients[spec.tenant].submit(spec.prompt, request_id=f"run-{name}", **spec.arguments())
                submitted[name] = job.job_id

        states: dict[str, int] = {}
        for client in clients.values():
            states.update({job.request.request_id: job.state for job in await client.list_jobs(limit=1000)})
        at_kill = {
            label: sorted(request_id for request_id, state in states.items() if state == wanted)
            for label, wanted in (("queued", QUEUED), ("running", RUNNING), ("finished", SUCCEEDED))
        }
        await asyncio.to_thread(cluster.kill, "orchestrator")  # SIGKILL
        killed_at = time.monotonic()
        print(
            f"\norchestrator SIGKILLed with {len(at_kill['queued'])} job(s) queued, {len(at_kill['running'])} running "
            f"(at denoising step {steps_seen[-1]}/{SLOW_STEPS}) and {len(at_kill['finished'])} finished"
        )
        assert at_kill["running"] == ["run-slow"], at_kill
        assert at_kill["queued"] == ["run-quick-a", "run-quick-b", "run-quick-c"], at_kill
        assert at_kill["finished"] == sorted(f"reference-{name}" for name in specs), at_kill
        assert steps_seen[-1] < SLOW_STEPS

        # Same port, same state directory.
        await asyncio.to_thread(cluster.restart, "orchestrator")
        serving_after = time.monotonic() - killed_at

        # A request id from before the kill names the same job, whether it was running, queued or finished;
        # a finished one streams its stored result again.
        for name in ("slow", "quick-b", "quick-c"):
            spec = specs[name]
            again = await clients[spec.tenant].submit(spec.prompt, request_id=f"run-{name}", **spec.arguments())
            assert again.job_id == submitted[name], f"run-{name} became a second job"
            assert again.state in (QUEUED, RUNNING, SUCCEEDED)
        spec = specs["quick-a"]
        again = await clients[spec.tenant].submit(spec.prompt, request_id="reference-quick-a", **spec.arguments())
        assert again.job_id == references["quick-a"].job_id and again.state == SUCCEEDED
        replayed = await generate(clients[spec.tenant], spec, "reference-quick-a")
        assert replayed.job_id == references["quick-a"].job_id
        assert_frames_once(replayed, spec)
        assert np.array_equal(replayed.frames, references["quick-a"].frames)

        # Every accepted job completes with the fault-free frames; the stream cut by the kill attached
        # again to its job, which resumed after its last finished stage.
        streamed = await asyncio.wait_for(streaming, CALL_TIMEOUT_S)
        assert streamed.job_id == submitted["slow"], "the resumed stream started a second job"
        assert_frames_once(streamed, slow)
        assert np.array_equal(streamed.frames, references["slow"].frames), "run-slow: streamed frames differ"
        encoded = [e for e in streamed.events if isinstance(e, Progress) and e.stage == "text-encoder"]
        assert len(encoded) == 1, "the recovered job encoded its prompt again instead of resuming after that stage"
        assert restarted_after_frames(streamed)[0], "the stream did not follow the job through its second run"
        recovered = await asyncio.gather(
            *(watch(clients[spec.tenant], submitted[name]) for name, spec in specs.items())
        )
        all_done_after = time.monotonic() - killed_at
        for (name, spec), outcome in zip(specs.items(), recovered, strict=True):
            assert outcome.job_id == submitted[name]
            assert_frames_once(outcome, spec)
            assert np.array_equal(outcome.frames, references[name].frames), f"run-{name}: frames differ"
            job = await clients[spec.tenant].get_job(outcome.job_id)
            assert job.state == SUCCEEDED and job.num_frames_out == spec.num_frames

        # Finished jobs stay downloadable: WatchJob replays each result as it was first received.
        for name, spec in specs.items():
            replay = await watch(clients[spec.tenant], references[name].job_id)
            assert replay.pieces == references[name].pieces, f"reference-{name}: replayed {replay.pieces}"
            assert np.array_equal(replay.frames, references[name].frames), f"reference-{name}: replay differs"

        # Each tenant lists exactly its jobs, once each, all SUCCEEDED.
        for tenant, client in clients.items():
            expected = {
                f"{kind}-{name}": spec
                for kind in ("reference", "run")
                for name, spec in specs.items()
                if spec.tenant == tenant
            }
            await assert_listed_exactly(client, tenant, expected)
        print(
            f"orchestrator SERVING again {serving_after:.1f} s after the kill; "
            f"all {len(specs)} interrupted jobs SUCCEEDED {all_done_after:.1f} s after the kill"
        )
    finally:
        for client in clients.values():
            await client.close()
