"""Step caches through the running cluster: a request names its cache, the frames equal WanPipeline's with
diffusers' own cache on the same transformer, the job reports the passes run and skipped, the next request
without a cache runs every pass, and a cache the model does not offer is refused at the door."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from diffusers.hooks import FirstBlockCacheConfig

from stagediff.client import Client, StageDiffError
from tests.helpers.references import reference_frames

CASE = {
    "prompt": "a red circle moves right",
    "negative_prompt": "blurry",
    "height": 48,
    "width": 80,
    "num_frames": 5,
    "steps": 8,
    "guidance": 4.0,
    "seed": 3,
}
THRESHOLD = 0.2


def _generate(client: Client, **cache):
    return client.generate(
        CASE["prompt"],
        negative_prompt=CASE["negative_prompt"],
        height=CASE["height"],
        width=CASE["width"],
        num_frames=CASE["num_frames"],
        num_inference_steps=CASE["steps"],
        guidance_scale=CASE["guidance"],
        seed=CASE["seed"],
        **cache,
    )


def _max_difference(frames: np.ndarray, expected: np.ndarray) -> int:
    assert frames.shape == expected.shape
    return int(np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max())


def test_first_block_cache_equals_pipeline_with_diffusers_cache(cluster, reference_pipeline) -> None:
    passes = 2 * CASE["steps"]  # a prompt and a negative-prompt pass per step
    with Client(cluster.endpoint) as client:
        cached = _generate(client, cache="first_block", cache_threshold=THRESHOLD)
        uncached = _generate(client)
        job = client.get_job(cached.job_id)
    transformer = reference_pipeline.transformer
    transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
    try:
        expected_cached = reference_frames(reference_pipeline, **CASE)
    finally:
        transformer.disable_cache()
    expected = reference_frames(reference_pipeline, **CASE)

    assert 0 < cached.passes_skipped < passes and cached.passes_run + cached.passes_skipped == passes
    assert _max_difference(cached.frames, expected_cached) <= 1
    # The cache came off after the request: the next one runs every pass, as the plain pipeline does.
    assert (uncached.passes_run, uncached.passes_skipped) == (passes, 0)
    assert _max_difference(uncached.frames, expected) <= 1
    assert _max_difference(cached.frames, expected) > 1, "the cache skipped passes but changed nothing"
    # The job records the cache it ran with and its passes.
    assert (job.request.cache.method, round(job.request.cache.threshold, 6)) == ("first_block", THRESHOLD)
    assert (job.transformer_passes.run, job.transformer_passes.skipped) == (cached.passes_run, cached.passes_skipped)


def test_teacache_skips_passes_and_the_model_lists_its_caches(cluster) -> None:
    with Client(cluster.endpoint) as client:
        result = _generate(client, cache="teacache", cache_threshold=0.5)
        limits = client.list_models()[0].limits
    # TeaCache runs the first five steps of each branch in full, then skips while the distance accumulates.
    assert result.passes_run >= 2 * 5 and result.passes_skipped > 0
    assert result.passes_run + result.passes_skipped == 2 * CASE["steps"]
    offered = {entry.method: entry.threshold for entry in limits.cache_methods}
    # The tiny checkpoint has no calibrated MagCache ratios, so mag is not offered.
    assert set(offered) == {"first_block", "teacache"}
    assert limits.default_cache.method == "none"


@pytest.mark.parametrize(
    ("cache", "words"),
    [
        ({"cache": "fast"}, ["cache.method", "'fast'", "allowed: none, first_block, teacache"]),
        ({"cache": "mag"}, ["cache.method", "'mag'", "not offered"]),
        ({"cache": "first_block", "cache_threshold": 1.5}, ["cache.threshold", "(0, 1]"]),
        ({"cache": "teacache", "cache_threshold": float("nan")}, ["cache.threshold"]),
        ({"cache": "none", "cache_threshold": 0.1}, ["cache.threshold", "method 'none'"]),
        ({"cache": "x" * 100}, ["cache.method", "at most 32"]),
    ],
)
def test_a_cache_the_model_does_not_offer_is_refused(cluster, cache, words) -> None:
    with Client(cluster.endpoint) as client, pytest.raises(StageDiffError) as raised:
        _generate(client, **cache)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
