"""End to end with a patch-parallel or tiled VAE and with the learned interpolator."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.conftest import THREADS_PER_STAGE, reference_frames, stage_channel
from tests.test_rife import random_state_dict

pytestmark = pytest.mark.e2e

CASES = [
    # 48 rows = 6 latent rows: an even split over 2 ranks; 80x48: 10 latent rows
    dict(prompt="a lighthouse at dusk", negative_prompt="blurry", height=48, width=80, num_frames=5, steps=2,
         guidance=5.0, seed=21),
    dict(prompt="a red fox", negative_prompt="", height=112, width=32, num_frames=9, steps=2, guidance=3.0, seed=5),
]


def _generate(client: Client, case: dict, **extra) -> np.ndarray:
    return client.generate(
        case["prompt"], negative_prompt=case["negative_prompt"], height=case["height"], width=case["width"],
        num_frames=case["num_frames"], num_inference_steps=case["steps"], guidance_scale=case["guidance"],
        seed=case["seed"], **extra,
    ).frames


def test_patch_parallel_vae_frames_equal_wan_pipeline(tiny_model, reference_pipeline, tmp_path) -> None:
    flags = {"vae": ["--vae-patch-parallel-size", "2"]}
    with LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path, extra_args=flags) as cluster, \
            Client(cluster.endpoint) as client:
        for case in CASES:
            frames = _generate(client, case)
            expected = reference_frames(reference_pipeline, **case)
            difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
            assert difference <= 1, f"{case['height']}x{case['width']}: max difference {difference} levels"
        vae = next(s for s in client.cluster_info().stages if s.info.stage == "vae")
        assert vae.info.parallel_config["vae_patch_parallel_size"] == "2"
        assert vae.info.limits.min_height == 16


def test_tiled_vae_is_close_but_approximate(tiny_model, reference_pipeline, tmp_path) -> None:
    tiles = ["--vae-use-tiling", "--vae-tile-sample-min-height", "32", "--vae-tile-sample-min-width", "32",
             "--vae-tile-sample-stride-height", "24", "--vae-tile-sample-stride-width", "24"]
    case = CASES[0]
    with LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path,
                      extra_args={"vae": tiles}) as cluster, Client(cluster.endpoint) as client:
        frames = _generate(client, case)
        vae = next(s for s in client.cluster_info().stages if s.info.stage == "vae")
    expected = reference_frames(reference_pipeline, **case)
    assert frames.shape == expected.shape
    assert "approximate" in vae.info.parallel_config["tiling"]
    # Tiles see only their window: close to the untiled decode on average, not equal.
    assert np.abs(frames.astype(np.float32) - expected.astype(np.float32)).mean() < 20


def test_learned_interpolator_through_the_cluster(tiny_model, tmp_path: Path) -> None:
    weights = tmp_path / "flownet.pkl"
    torch.save(random_state_dict(seed=0), weights)
    case = CASES[0]
    with LocalCluster(tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path,
                      extra_args={"interp": ["--interp-model-path", str(weights)]}) as cluster, \
            Client(cluster.endpoint) as client:
        base = _generate(client, case)
        dense = _generate(client, case, interp_exp=1, interp_model_path=str(weights))
        half_scale = _generate(client, case, interp_exp=1, interp_scale=0.5)
        with pytest.raises(StageDiffError) as raised:
            _generate(client, case, interp_exp=1, interp_model_path="/elsewhere/flownet.pkl")
        interp = next(s for s in client.cluster_info().stages if s.info.stage == "interp")
        jobs = client.list_jobs()
    assert dense.shape[0] == (base.shape[0] - 1) * 2 + 1 and np.array_equal(dense[::2], base)
    assert half_scale.shape == dense.shape
    # Refused at admission, before any stage ran, without telling the tenant where the served weights live.
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and "interpolation.model_path" in raised.value.message
    assert str(weights) not in raised.value.message
    assert not [job for job in jobs if job.request.interpolation.model_path == "/elsewhere/flownet.pkl"]
    assert interp.info.weights_path == str(weights)
    assert "RIFE" in interp.info.parallel_config["method"]
    assert interp.info.parameter_bytes["rife"] == 4_866_052 * 4


def test_patch_parallel_vae_refuses_too_few_rows(tiny_model, tmp_path) -> None:
    """Three ranks need three latent rows: the stage says so, and reports its smallest height."""
    import socket
    import subprocess
    import sys

    import grpc

    from services.torch_wire import encode_tensor
    from stagediff.local.supervisor import wait_for_serving
    from stagediff.v1 import stages_pb2, stages_pb2_grpc

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "vae.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "serve", "vae", "--model", str(tiny_model), "--host", "127.0.0.1",
         "--port", str(port), "--threads", "1", "--vae-patch-parallel-size", "3"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for_serving(f"127.0.0.1:{port}", timeout=120)
        with stage_channel(f"127.0.0.1:{port}") as channel:
            info = stages_pb2_grpc.StageControlStub(channel).GetStageInfo(stages_pb2.GetStageInfoRequest())
            assert info.limits.min_height == 32  # 3 latent rows of 8 pixels, rounded up to a multiple of 16
            messages = [stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=1))]
            latent = torch.zeros(1, 16, 1, 2, 8)
            messages += [stages_pb2.DecodeRequest(tensor=chunk) for chunk in encode_tensor("latents", latent)]
            with pytest.raises(grpc.RpcError) as raised:
                list(stages_pb2_grpc.VaeDecoderStub(channel).Decode(iter(messages), timeout=60))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "h=2 rows cannot be split over 3" in raised.value.details()
            # The group is intact: a frame with enough rows decodes.
            latent = torch.zeros(1, 16, 1, 4, 8)
            messages = [stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=1))]
            messages += [stages_pb2.DecodeRequest(tensor=chunk) for chunk in encode_tensor("latents", latent)]
            responses = list(stages_pb2_grpc.VaeDecoderStub(channel).Decode(iter(messages), timeout=60))
            assert responses[0].tensor.header.shape == [1, 32, 64, 3]
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
