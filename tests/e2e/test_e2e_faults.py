"""Real faults: a stage process killed mid-request ends the request with UNAVAILABLE naming the stage."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def doomed_cluster(tiny_model, tmp_path_factory):
    """A cluster of its own, since its stages get killed."""
    local = LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path_factory.mktemp("faults"))
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def test_killing_the_dit_mid_request_ends_it_with_unavailable(doomed_cluster) -> None:
    cluster = doomed_cluster
    outcome: dict[str, object] = {}
    dit_running = threading.Event()

    def generate() -> None:
        with Client(cluster.endpoint) as client:
            try:
                client.generate(
                    "a long video",
                    seed=0,
                    height=64,
                    width=64,
                    num_frames=9,
                    num_inference_steps=500,
                    on_progress=lambda e: dit_running.set(),
                )
            except StageDiffError as error:
                outcome["error"] = error
                outcome["at"] = time.monotonic()

    worker = threading.Thread(target=generate)
    worker.start()
    assert dit_running.wait(timeout=120), "the job never started"
    time.sleep(0.5)
    os.kill(cluster.services["dit"].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the request hung after the stage died"
    error = outcome["error"]
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "'dit'" in error.message and cluster.services["dit"].endpoint in error.message
    assert outcome["at"] - killed_at < 15

    with Client(cluster.endpoint) as client:
        assert client.health() == "SERVING"
        stages = {s.info.stage: s for s in client.cluster_info().stages}
        assert stages["dit"].health == "NOT_SERVING" and "unreachable" in stages["dit"].detail
        for other in ("text-encoder", "vae", "interp"):
            assert stages[other].health == "SERVING"


def test_a_dead_stage_fails_new_requests_quickly(doomed_cluster) -> None:
    cluster = doomed_cluster
    os.kill(cluster.services["text-encoder"].pid, signal.SIGKILL)
    cluster.services["text-encoder"].process.wait(timeout=30)
    started = time.monotonic()
    with Client(cluster.endpoint) as client, pytest.raises(StageDiffError) as raised:
        client.generate("anything", seed=0, height=64, width=64, num_frames=9, num_inference_steps=2)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert "'text-encoder'" in raised.value.message
    assert time.monotonic() - started < 15
