"""Stage pools of several replicas: least-loaded choice, taking replicas out and back, failover.

The pool tests run against small real aio servers that answer grpc.health.v1
and GetStageInfo; the end-to-end test kills and restarts real stage processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from stagediff import Client
from stagediff.client import FramesReceived, GenerationResult, Progress
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2
from tests.helpers.fake_replicas import SETTLE_S
from tests.helpers.serving import THREADS_PER_STAGE

SMALL = dict(height=64, width=64, num_frames=9, num_inference_steps=60, guidance_scale=5.0)
SEEDS = (11, 12, 13, 14)


@pytest.fixture(scope="module")
def replicated_cluster(tiny_model, tmp_path_factory):
    """2 DiT and 2 VAE replicas; the orchestrator gets no retries, so only free failovers can save a job."""
    local = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("replicas"),
        replicas={"dit": 2, "vae": 2},
        extra_args={"orchestrator": ["--stage-retries", "0", "--health-interval", "0.2"]},
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def _replicas(client: Client) -> dict[str, generation_pb2.ReplicaStatus]:
    return {replica.endpoint: replica for stage in client.cluster_info().stages for replica in stage.replicas}


def _stream_all(endpoint: str, on_event: Callable[[int, object], None] | None = None) -> dict[int, list[object]]:
    """Runs one job per seed at once; returns each job's events."""
    events: dict[int, list[object]] = {seed: [] for seed in SEEDS}

    def run(seed: int) -> None:
        with Client(endpoint) as client:
            for event in client.stream("replicas", seed=seed, **SMALL):
                events[seed].append(event)
                if on_event is not None:
                    on_event(seed, event)

    workers = [threading.Thread(target=run, args=(seed,)) for seed in SEEDS]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert not any(worker.is_alive() for worker in workers), "a job hung"
    return events


def _frames(events: list[object]) -> np.ndarray:
    received = [(e.first_frame, e.count) for e in events if isinstance(e, FramesReceived)]
    starts = [first for first, _ in received]
    assert starts == sorted(set(starts)), f"frames sent twice or out of order: {received}"
    assert sum(count for _, count in received) == SMALL["num_frames"]
    assert isinstance(events[-1], GenerationResult), events[-1]
    return events[-1].frames


@pytest.mark.e2e
def test_killing_a_dit_and_a_vae_replica_mid_run_loses_no_job(replicated_cluster) -> None:
    cluster = replicated_cluster
    assert cluster.replicas("dit") == ["dit", "dit-2"] and cluster.replicas("vae") == ["vae", "vae-2"]
    expected = {seed: _frames(events) for seed, events in _stream_all(cluster.endpoint).items()}
    with Client(cluster.endpoint) as client:
        served = _replicas(client)
    for name in ("dit", "dit-2", "vae", "vae-2"):
        assert served[cluster.services[name].endpoint].calls > 0, f"{name} took no call"

    # Once two jobs are denoising, kill the busiest replica of each stage: calls die mid-stream.
    denoising: set[int] = set()
    two_denoising = threading.Event()
    victims: dict[str, str] = {}  # stage -> service name
    killed_in_flight: dict[str, int] = {}

    def on_event(seed: int, event: object) -> None:
        if isinstance(event, Progress) and event.stage == "dit":
            denoising.add(seed)
            if len(denoising) >= 2:
                two_denoising.set()

    def kill_the_busiest() -> None:
        assert two_denoising.wait(timeout=300)
        with Client(cluster.endpoint) as client:
            served = _replicas(client)
        for stage in ("dit", "vae"):
            name = max(cluster.replicas(stage), key=lambda n: served[cluster.services[n].endpoint].in_flight)
            victims[stage] = name
            killed_in_flight[stage] = served[cluster.services[name].endpoint].in_flight
        for name in victims.values():
            cluster.kill(name)  # SIGKILL

    killer = threading.Thread(target=kill_the_busiest)
    killer.start()
    events = _stream_all(cluster.endpoint, on_event)
    killer.join(timeout=60)
    assert killed_in_flight["dit"] > 0 and killed_in_flight["vae"] > 0, killed_in_flight
    for seed in SEEDS:
        assert np.array_equal(_frames(events[seed]), expected[seed]), f"seed {seed}: frames differ"
    dit_steps = {seed: [e.step for e in events[seed] if isinstance(e, Progress) and e.stage == "dit"] for seed in SEEDS}
    restarted = [seed for seed, steps in dit_steps.items() if steps != sorted(set(steps))]
    assert restarted, "no job's denoising was cut and moved to the other replica"

    # Restarted, the killed replicas are back in rotation and take calls again.
    for name in victims.values():
        cluster.restart(name)
    with Client(cluster.endpoint) as client:
        give_up_at = time.monotonic() + SETTLE_S
        while True:
            served = _replicas(client)
            if all(replica.health == "SERVING" for replica in served.values()):
                break
            assert time.monotonic() < give_up_at, {e: (r.health, r.detail) for e, r in served.items()}
            time.sleep(0.2)
        before = {name: served[cluster.services[name].endpoint].calls for name in victims.values()}
        # The interpolator does not read the diffusers checkpoint: its weights are its own.
        assert all(
            replica.info.model == ("" if replica.info.stage == "interp" else "tiny") for replica in served.values()
        )
        jobs = [client.submit("again", seed=seed, **{**SMALL, "num_inference_steps": 2}) for seed in SEEDS[:2]]
        for job in jobs:
            assert client.wait(job.job_id).frames.shape == (9, 64, 64, 3)
        served = _replicas(client)
    for name in victims.values():
        assert served[cluster.services[name].endpoint].calls > before[name], f"restarted {name} took no call"
