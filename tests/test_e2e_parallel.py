"""End to end with a parallel DiT group: frames still equal WanPipeline's; layouts are reported and checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.conftest import THREADS_PER_STAGE, reference_frames

pytestmark = pytest.mark.e2e

# Each method through the running service, once. Every layout and combination is proven at the level
# of the latents in tests/test_dit_parallel.py (world sizes 2 and 4); Ulysses over 4 ranks runs through
# the cluster in tests/test_e2e_compose_gpu_file.py (the shipped compose file's layout).
FLAG_SETS = {
    "ring2": ["--ring-degree", "2"],
    "usp2x2": ["--ulysses-degree", "2", "--ring-degree", "2"],
    "cfg2": ["--cfg-parallel-size", "2"],
    "tp2xcfg2": ["--tensor-parallel-size", "2", "--cfg-parallel-size", "2"],
    "hsdp2xulysses2": ["--ulysses-degree", "2", "--use-hsdp", "--hsdp-shard-size", "2"],
}
# 48x80 with 5 frames: 2 x 3 x 5 = 30 tokens, not divisible by 4.
CASE = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", height=48, width=80, num_frames=5, steps=2,
            guidance=5.0, seed=21)


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_parallel_dit_frames_equal_wan_pipeline(tiny_model, reference_pipeline, tmp_path, name) -> None:
    with LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path,
                      extra_args={"dit": FLAG_SETS[name]}) as cluster, Client(cluster.endpoint) as client:
        result = client.generate(
            CASE["prompt"], negative_prompt=CASE["negative_prompt"], height=CASE["height"],
            width=CASE["width"], num_frames=CASE["num_frames"], num_inference_steps=CASE["steps"],
            guidance_scale=CASE["guidance"], seed=CASE["seed"],
        )
        dit = next(s for s in client.cluster_info().stages if s.info.stage == "dit")
    expected = reference_frames(reference_pipeline, **CASE)
    difference = np.abs(result.frames.astype(np.int16) - expected.astype(np.int16)).max()
    assert difference <= 1, f"{name}: max difference {difference} levels"
    layout = dit.info.parallel_config
    world = 1
    for flag, value in zip(FLAG_SETS[name], FLAG_SETS[name][1:] + [""], strict=True):
        if flag in ("--ulysses-degree", "--ring-degree", "--cfg-parallel-size", "--tensor-parallel-size"):
            world *= int(value)
    assert int(layout["world_size"]) == max(world, 2 if "hsdp" in name else 1)
    assert "mesh" in layout and "devices" in layout


def test_a_dead_rank_turns_the_dit_not_serving(tiny_model, tmp_path) -> None:
    with LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path,
                      extra_args={"dit": ["--cfg-parallel-size", "2"]}) as cluster:
        dit_pid = cluster.services["dit"].pid
        followers = subprocess.run(["pgrep", "-P", str(dit_pid)], capture_output=True, text=True).stdout.split()
        assert followers, "the DiT stage started no follower rank"
        outcome: dict[str, object] = {}
        running = threading.Event()

        def generate() -> None:
            with Client(cluster.endpoint) as client:
                try:
                    client.generate("long", seed=0, height=64, width=64, num_frames=9, num_inference_steps=400,
                                    on_progress=lambda e: running.set())
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
                dit = next(s for s in client.cluster_info().stages if s.info.stage == "dit")
                if dit.health == "NOT_SERVING":
                    break
                assert time.monotonic() < deadline, "the DiT stage kept saying SERVING"
                time.sleep(0.5)
        log = (tmp_path / "dit.log").read_text()
        assert "cannot serve any more" in log and "exited with code" in log


def test_an_impossible_layout_is_refused_at_startup(tiny_model) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(tiny_model), "--port", "0",
         "--ulysses-degree", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode != 0
    assert "4 attention heads" in completed.stderr and "[1, 2, 4]" in completed.stderr
