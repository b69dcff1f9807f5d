"""End to end with a tiled VAE and the learned interpolator, both in one cluster: tiled frames are close to the
untiled pipeline's, and the interpolator keeps the decoded frames in place between its own.

Tiled decode equals diffusers' tiled decode in tests/integration/test_vae_patch_parallel.py; RIFE and the
interpolation's frame order are proven in tests/unit/test_rife.py and tests/unit/test_interpolate.py. The
patch-parallel VAE runs through the cluster in tests/e2e/test_e2e_parallel.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.references import reference_frames
from tests.helpers.rife_weights import random_state_dict
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e


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
TILES = [
    "--vae-use-tiling",
    "--vae-tile-sample-min-height",
    "32",
    "--vae-tile-sample-min-width",
    "32",
    "--vae-tile-sample-stride-height",
    "24",
    "--vae-tile-sample-stride-width",
    "24",
]


@pytest.fixture(scope="module")
def interp_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    weights = tmp_path_factory.mktemp("rife") / "flownet.pkl"
    torch.save(random_state_dict(seed=0), weights)
    return weights


@pytest.fixture(scope="module")
def vae_interp_cluster(
    tiny_model: Path, interp_weights: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("vae-interp-logs"),
        extra_args={"vae": TILES, "interp": ["--interp-model-path", str(interp_weights)]},
    )
    cluster.start(timeout=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def _generate(client: Client, case: dict, **extra) -> np.ndarray:
    return client.generate(
        case["prompt"],
        negative_prompt=case["negative_prompt"],
        height=case["height"],
        width=case["width"],
        num_frames=case["num_frames"],
        num_inference_steps=case["steps"],
        guidance_scale=case["guidance"],
        seed=case["seed"],
        **extra,
    ).frames


def test_tiled_vae_is_close_but_approximate(vae_interp_cluster, reference_pipeline) -> None:
    with Client(vae_interp_cluster.endpoint) as client:
        frames = _generate(client, CASE)
        vae = next(s for s in client.cluster_info().stages if s.info.stage == "vae")
    expected = reference_frames(reference_pipeline, **CASE)
    assert frames.shape == expected.shape
    assert "approximate" in vae.info.parallel_config["tiling"]
    # Tiles see only their window: close to the untiled decode on average, not equal.
    assert np.abs(frames.astype(np.float32) - expected.astype(np.float32)).mean() < 20


def test_learned_interpolator_through_the_cluster(vae_interp_cluster, interp_weights: Path) -> None:
    weights = interp_weights
    with Client(vae_interp_cluster.endpoint) as client:
        base = _generate(client, CASE)
        dense = _generate(client, CASE, interp_exp=1, interp_model_path=str(weights))
        half_scale = _generate(client, CASE, interp_exp=1, interp_scale=0.5)
        with pytest.raises(StageDiffError) as raised:
            _generate(client, CASE, interp_exp=1, interp_model_path="/elsewhere/flownet.pkl")
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
