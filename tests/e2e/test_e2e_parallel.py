"""End to end with parallel stages: a DiT group (HSDP over Ulysses) and a patch-parallel VAE in one cluster give
WanPipeline's frames, report their layouts, drain as one group on SIGTERM, and a dead DiT rank turns the DiT
not serving.

Every DiT layout and combination is proven on the latents in tests/integration/test_family_features.py
(TestWanT2VParallelLayouts) and tests/integration/test_tensor_parallel_hsdp.py, the patch-parallel VAE in
tests/integration/test_vae_patch_parallel.py; Ulysses over 4 ranks runs through the cluster in
tests/e2e/test_e2e_compose_gpu_file.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from stagediff.results import Progress
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e


DIT_FLAGS = ["--ulysses-degree", "2", "--use-hsdp", "--hsdp-shard-size", "2"]
VAE_FLAGS = ["--vae-patch-parallel-size", "2"]


# 48x80 with 5 frames: 2 x 3 x 5 = 30 tokens; 48 rows = 6 latent rows, an even split over 2 VAE ranks.
CASE = dict(
    prompt="a lighthouse at dusk",
    negative_prompt="blurry",
    height=48,
    width=80,
    num_frames=5,
    steps=2,
    guidance=5.0,
    seed=21,
)
# 112 rows = 14 latent rows over 2 VAE ranks, 9 frames.
TALL_CASE = dict(
    prompt="a red fox", negative_prompt="", height=112, width=32, num_frames=9, steps=2, guidance=3.0, seed=5
)


@pytest.fixture(scope="module")
def parallel_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    """One cluster for the module; the dead-rank test, its last user, breaks it."""
    log_dir = tmp_path_factory.mktemp("parallel-logs")
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=log_dir,
        extra_args={"dit": DIT_FLAGS, "vae": VAE_FLAGS},
    )
    cluster.start(timeout=300)
    try:
        yield cluster, log_dir
    finally:
        cluster.stop()


def _generate(client: Client, case: dict, on_progress: Callable[[object], None] | None = None) -> np.ndarray:
    return client.generate(
        case["prompt"],
        negative_prompt=case["negative_prompt"],
        height=case["height"],
        width=case["width"],
        num_frames=case["num_frames"],
        num_inference_steps=case["steps"],
        guidance_scale=case["guidance"],
        seed=case["seed"],
        on_progress=on_progress,
    ).frames


def _stage(client: Client, name: str):
    return next(s for s in client.cluster_info().stages if s.info.stage == name)


def test_parallel_dit_frames_equal_wan_pipeline(parallel_cluster, reference_pipeline) -> None:
    cluster, _ = parallel_cluster
    with Client(cluster.endpoint) as client:
        frames = _generate(client, CASE)
        dit = _stage(client, "dit")
    expected = reference_frames(reference_pipeline, **CASE)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
    assert difference <= 1, f"max difference {difference} levels"
    layout = dit.info.parallel_config
    assert int(layout["world_size"]) == 2
    assert "mesh" in layout and "devices" in layout


def test_patch_parallel_vae_frames_equal_wan_pipeline(parallel_cluster, reference_pipeline) -> None:
    cluster, _ = parallel_cluster
    with Client(cluster.endpoint) as client:
        for case in (CASE, TALL_CASE):
            frames = _generate(client, case)
            expected = reference_frames(reference_pipeline, **case)
            difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
            assert difference <= 1, f"{case['height']}x{case['width']}: max difference {difference} levels"
        vae = _stage(client, "vae")
    assert vae.info.parallel_config["vae_patch_parallel_size"] == "2"
    assert vae.info.limits.min_height == 16


def test_a_dit_group_told_to_stop_finishes_its_call(parallel_cluster) -> None:
    """SIGTERM to the DiT's whole process group, its follower rank included (as a terminal or `kill -- -PGID`
    sends it), while a call runs: the group drains as one (the follower leaves the signal to rank 0), the call
    ends with the frames of an undisturbed run, and the DiT exits 0. It is started again for the next test."""
    cluster, _ = parallel_cluster
    case = dict(CASE, steps=12)
    with Client(cluster.endpoint) as client:
        undisturbed = _generate(client, case)
    running = threading.Event()
    outcome: dict[str, object] = {}

    def on_progress(event: object) -> None:
        if isinstance(event, Progress) and event.stage == "dit":
            running.set()

    def generate() -> None:
        with Client(cluster.endpoint) as client:
            try:
                outcome["frames"] = _generate(client, case, on_progress)
            except StageDiffError as error:
                outcome["error"] = error

    worker = threading.Thread(target=generate)
    worker.start()
    assert running.wait(timeout=120)
    cluster.kill("dit", signal.SIGTERM)  # the whole session; returns once the DiT has exited
    worker.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert np.array_equal(outcome["frames"], undisturbed)
    assert cluster.services["dit"].process.returncode == 0
    cluster.restart("dit")


def test_a_dead_rank_turns_the_dit_not_serving(parallel_cluster) -> None:
    """Runs last: it kills the DiT's follower rank."""
    cluster, log_dir = parallel_cluster
    dit_pid = cluster.services["dit"].pid
    followers = subprocess.run(["pgrep", "-P", str(dit_pid)], capture_output=True, text=True).stdout.split()
    assert followers, "the DiT stage started no follower rank"
    outcome: dict[str, object] = {}
    running = threading.Event()

    def generate() -> None:
        with Client(cluster.endpoint) as client:
            try:
                client.generate(
                    "long",
                    seed=0,
                    height=64,
                    width=64,
                    num_frames=9,
                    num_inference_steps=400,
                    on_progress=lambda e: running.set(),
                )
            except StageDiffError as error:
                outcome["error"] = error

    worker = threading.Thread(target=generate)
    worker.start()
    assert running.wait(timeout=120)
    time.sleep(1.0)
    for pid in followers:
        os.kill(int(pid), signal.SIGKILL)
    worker.join(timeout=120)
    assert not worker.is_alive(), "the request hung after a rank died"
    assert outcome["error"].code == grpc.StatusCode.UNAVAILABLE and "dit" in outcome["error"].message
    deadline = time.monotonic() + 30
    with Client(cluster.endpoint) as client:
        while True:
            if _stage(client, "dit").health == "NOT_SERVING":
                break
            assert time.monotonic() < deadline, "the DiT stage kept saying SERVING"
            time.sleep(0.5)
    log = (log_dir / "dit.log").read_text()
    assert "cannot serve any more" in log and "exited with code" in log
