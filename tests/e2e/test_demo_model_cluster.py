"""The trained demo model through the local cluster: frame for frame as diffusers makes it, and its colour-swapping
adapter for one tenant among interleaved requests. One cluster serves both (`demo_cluster`, tests/e2e/conftest.py):
its DiT serves the adapters folder, and a request without adapters gets the base model's frames
(tests/integration/test_lora.py)."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import numpy as np
import pytest

from shapeworld.demo_model import DEFAULT_REQUEST
from shapeworld.score import ATTRIBUTES, read_video, score
from shapeworld.world import parse_prompt
from stagediff.client import Client, StageDiffError
from tests.helpers.demo_model import PROMPTS, diffusers_frames

pytestmark = pytest.mark.e2e

DEMO_PROMPT = "a red circle moving right on a dark background"


def test_cluster_serves_the_demo_model_as_diffusers_does(demo_cluster, demo_pipeline) -> None:
    cluster, keys = demo_cluster
    with Client(cluster.endpoint, api_key=keys["globex"]) as client:
        results = [(prompt, seed, client.generate(prompt, seed=seed).frames) for prompt, seed in PROMPTS]
        mp4 = client.generate(PROMPTS[1][0], seed=PROMPTS[1][1], output_format="mp4")
    for prompt, seed, frames in results:
        assert frames.shape == (DEFAULT_REQUEST["num_frames"], DEFAULT_REQUEST["height"], DEFAULT_REQUEST["width"], 3)
        # Each video passes the quality check: shape, colour, motion and background as the prompt says.
        right = score(read_video(frames), parse_prompt(prompt))
        assert right == {name: True for name in ATTRIBUTES}, (prompt, seed, right)
    # And the cluster's frames are diffusers' frames (its defaults are the model's: stagediff.json).
    prompt, seed, frames = results[1]
    expected = diffusers_frames(demo_pipeline, prompt, seed)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1
    # The same video as the server's MP4 is over 20x smaller on the wire, and within 30 dB of the frames.
    assert mp4.media_type == "video/mp4" and frames.nbytes / len(mp4.data) >= 20
    error = np.mean((mp4.frames.astype(float) - frames.astype(float)) ** 2)
    assert 10 * np.log10(255**2 / error) >= 30


def test_demo_adapter_swaps_a_colour_for_its_tenant_only(demo_cluster) -> None:
    """The demo model's red_to_blue adapter (shapeworld/red_to_blue.py), allowed to acme only: in requests of
    acme (with it) and globex (without it) submitted interleaved, acme's red circles read blue and globex's red,
    shape, motion and background as asked, globex's frames exactly those of its request run alone; globex may not
    name the adapter."""
    cluster, keys = demo_cluster
    results: dict[tuple[str, int], np.ndarray] = {}

    def run(tenant: str, seed: int) -> None:
        loras = {"red_to_blue": 1.0} if tenant == "acme" else {}
        with Client(cluster.endpoint, api_key=keys[tenant]) as client:
            results[tenant, seed] = client.generate(DEMO_PROMPT, seed=seed, loras=loras).frames

    run("globex", 1)
    alone = results.pop(("globex", 1))
    threads = [threading.Thread(target=run, args=(tenant, seed)) for seed in (1, 2) for tenant in ("acme", "globex")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    with Client(cluster.endpoint, api_key=keys["globex"]) as globex, pytest.raises(StageDiffError) as error:
        globex.submit(DEMO_PROMPT, loras={"red_to_blue": 1.0})
    assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert np.array_equal(results["globex", 1], alone), "acme's adapter must not touch globex's frames"
    asked = parse_prompt(DEMO_PROMPT)
    swapped = dataclasses.replace(asked, colour="blue")
    assert len(results) == 4
    for (tenant, seed), frames in results.items():
        # The demo's quality check: every attribute as the prompt says, the colour swapped for acme.
        right = score(read_video(frames), swapped if tenant == "acme" else asked)
        assert right == {name: True for name in ATTRIBUTES}, (tenant, seed, right)
