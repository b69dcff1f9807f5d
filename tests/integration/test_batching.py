"""Batched denoising: under the parallel layouts of every family that batches, every rank's rows equal each
request run alone and every rank keeps the batch rank 0 decides; batch keys; the batcher. (That each request
of a batch gets its own run's latents and a member can leave, on one rank, is BatchingTesterMixin's in
tests/integration/test_family_features.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from dit_svc.batching import RequestBatcher
from dit_svc.denoise import batch_key
from dit_svc.step_cache import CachePasses
from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.parallel.launch import run_ranks
from tests.helpers.feature_mixins import TESTER_CONFIGS, FamilyTesterConfig
from tests.helpers.feature_mixins.base import checkpoint
from tests.helpers.feature_mixins.batching import batch_specs

TOLERANCE = 1e-4
BASE = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=0)
# Different seeds, prompts and guidance scales: everything a batch may mix.
SPECS = [
    dataclasses.replace(BASE, seed=1, guidance_scale=4.0),
    dataclasses.replace(BASE, seed=2, guidance_scale=5.5),
    dataclasses.replace(BASE, seed=3, guidance_scale=3.7),
]


def test_batch_keys_separate_what_cannot_share_a_batch() -> None:
    conditioning = {"prompt_embeds": torch.zeros(1, 24, 16), "negative_prompt_embeds": torch.zeros(1, 24, 16)}
    key = batch_key(SPECS[0], conditioning)
    assert key == batch_key(SPECS[1], conditioning) == batch_key(SPECS[2], conditioning)
    assert batch_key(dataclasses.replace(BASE, num_inference_steps=5), conditioning) != key
    assert batch_key(dataclasses.replace(BASE, height=64), conditioning) != key
    assert batch_key(dataclasses.replace(BASE, guidance_scale=1.0), conditioning) != key
    assert batch_key(BASE, {**conditioning, "prompt_embeds": torch.zeros(1, 20, 16)}) != key
    # A step cache decides per request: such requests run alone.
    assert batch_key(dataclasses.replace(BASE, cache=CacheSpec("first_block", 0.1)), conditioning) is None


def _assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    difference = (got - want).abs().max().item()
    assert difference <= TOLERANCE, (what, difference)


def _batch(config: FamilyTesterConfig, denoiser: Any, leaves: bool) -> list[torch.Tensor | None]:
    """The config's test batch (BatchingTesterMixin's); with `leaves`, its first member leaves after one step."""
    specs = batch_specs(config.spec)
    conditionings = [config.conditioning(denoiser, spec) for spec in specs]
    steps = [0] * len(specs)

    def on_step(member: int, step: int, total: int) -> None:
        steps[member] = step

    def wanted() -> list[bool]:
        return [not (leaves and member == 0 and steps[0] >= 1) for member in range(len(specs))]

    return denoiser.denoise_batch(specs, conditionings, on_step, wanted)


def _rank_batches(rank: int, world_size: int, cases: list[tuple[type[FamilyTesterConfig], str]]) -> dict:
    """On one rank, by family and layout: the whole batch, then the batch whose first member leaves (seen by
    rank 0 only: the others must follow its decision)."""
    results: dict[str, dict[str, list]] = {}
    for config_class, model_dir in cases:
        config = config_class()
        results[config.family] = {}
        for name, layout in config.batch_layouts:
            denoiser = config.build_denoiser(Path(model_dir), torch.float32, parallel=layout)
            results[config.family][name] = [_batch(config, denoiser, False), _batch(config, denoiser, rank == 0)]
    return results


# The tester configs whose batches run under parallel layouts: all of them in one spawn of two ranks.
BATCH_CONFIGS = [config for config in TESTER_CONFIGS if config.batch_layouts]


def test_batches_under_parallel_layouts_equal_one_rank_alone(request: pytest.FixtureRequest) -> None:
    """Under each batching tester config's `batch_layouts` (Wan: every method; FLUX.1: Ulysses, CFG-parallel and
    TP), every rank's rows equal each request run alone on one rank, and every rank drops the member rank 0
    drops."""
    assert {config.family for config in BATCH_CONFIGS} >= {"wan-t2v", "flux"}
    cases, expected = [], {}
    for config_class in BATCH_CONFIGS:
        config = config_class()
        model_dir = checkpoint(config, request)
        denoiser = config.build_denoiser(model_dir, torch.float32)
        expected[config.family] = [
            denoiser.denoise(spec, config.conditioning(denoiser, spec), lambda step, total: None, lambda: False)
            for spec in batch_specs(config.spec)
        ]
        cases.append((config_class, str(model_dir)))
    per_rank = run_ranks(_rank_batches, 2, cases)
    for rank, families in enumerate(per_rank):
        for family, layouts in families.items():
            for name, (whole, after_leaving) in layouts.items():
                assert after_leaving[0] is None, (family, name, rank)
                for index, alone in enumerate(expected[family]):
                    _assert_close(whole[index], alone, (family, name, rank, index))
                    if index:
                        _assert_close(after_leaving[index], alone, (family, name, rank, index, "after a leave"))


class _ComputeThread:
    """The one method of StageRuntime the batcher uses: run blocking work off the event loop."""

    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


def _stream_all(batcher: RequestBatcher, seed: int, key: str):
    async def collect():
        return [item async for item in batcher.stream(dataclasses.replace(BASE, seed=seed), {}, (key,))]

    return collect()


def test_the_batcher_groups_by_key_and_hands_each_request_only_its_own_results() -> None:
    batches: list[list[int]] = []

    def run_batch(specs, conditionings, on_step, wanted):
        batches.append([spec.seed for spec in specs])
        for member in range(len(specs)):
            on_step(member, 1, 1)
        return [(torch.full((1, 1, 1, 1, 1), float(spec.seed)), CachePasses(run=2)) for spec in specs]

    async def three_requests():
        batcher = RequestBatcher(_ComputeThread(), run_batch, max_batch_size=2, wait_ms=500)
        return await asyncio.gather(
            _stream_all(batcher, 1, "a"), _stream_all(batcher, 2, "b"), _stream_all(batcher, 3, "a")
        )

    results = asyncio.run(three_requests())
    assert sorted(batches) == [[1, 3], [2]]
    for seed, (progress, passes, latents) in zip((1, 2, 3), results, strict=True):
        assert (progress.step, progress.total, passes.run) == (1, 1, 2)
        assert latents.item() == seed


def test_a_failed_batch_fails_each_of_its_requests() -> None:
    def run_batch(specs, conditionings, on_step, wanted):
        raise RuntimeError("out of memory in the batch")

    async def two_requests():
        batcher = RequestBatcher(_ComputeThread(), run_batch, max_batch_size=2, wait_ms=500)
        return await asyncio.gather(_stream_all(batcher, 1, "a"), _stream_all(batcher, 2, "a"), return_exceptions=True)

    for outcome in asyncio.run(two_requests()):
        assert isinstance(outcome, RuntimeError) and "out of memory" in str(outcome)
