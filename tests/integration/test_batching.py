"""Batched denoising (WanDenoiser.denoise_batch): a request dropped mid-way leaves the others unchanged, and
under every parallel layout every rank keeps the batch rank 0 decides. (That each request of a batch gets its
own run's latents, for each family that batches, is tests/integration/test_family_features.py's.)"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from dit_svc.batching import RequestBatcher
from dit_svc.denoise import batch_key
from dit_svc.step_cache import CachePasses
from families.wan.denoise import WanDenoiser
from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

CPU = torch.device("cpu")
TOLERANCE = 1e-4
BASE = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=0)
# Different seeds, prompts and guidance scales: everything a batch may mix.
SPECS = [
    dataclasses.replace(BASE, seed=1, guidance_scale=4.0),
    dataclasses.replace(BASE, seed=2, guidance_scale=5.5),
    dataclasses.replace(BASE, seed=3, guidance_scale=3.7),
]
# Every layout the DiT runs: sequence parallel (the batch's rows travel together through the all-to-alls and the
# ring), CFG-parallel, and the sharded weights of tensor parallelism and HSDP.
LAYOUTS = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("ring2", ParallelConfig(ring_degree=2)),
    ("cfg2", ParallelConfig(cfg_degree=2)),
    ("tp2", ParallelConfig(tp_degree=2)),
    ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
]


def _conditionings(text_dim: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        }
        for _ in SPECS
    ]


def _alone(denoiser) -> list[torch.Tensor]:
    conditionings = _conditionings(denoiser.text_dim)
    return [
        denoiser.denoise(spec, conditioning, lambda s, t: None, lambda: False)
        for spec, conditioning in zip(SPECS, conditionings, strict=True)
    ]


def _batched(denoiser, drop: int | None = None, after_step: int = 2) -> tuple[list, list]:
    """The batch's latents, and the steps each member was told of; member `drop` is unwanted after `after_step`."""
    steps: list[list[int]] = [[] for _ in SPECS]

    def on_step(member: int, step: int, total: int) -> None:
        steps[member].append(step)

    def wanted() -> list[bool]:
        done = len(steps[0]) if drop != 0 else len(steps[1])
        return [member != drop or done < after_step for member in range(len(SPECS))]

    results = denoiser.denoise_batch(SPECS, _conditionings(denoiser.text_dim), on_step, wanted)
    return results, steps


def _assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    difference = (got - want).abs().max().item()
    assert difference <= TOLERANCE, (what, difference)


def test_a_dropped_request_stops_and_leaves_the_others_unchanged(tiny_model) -> None:
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    expected = _alone(denoiser)
    results, steps = _batched(denoiser, drop=1, after_step=2)
    assert results[1] is None and steps[1] == [1, 2]
    for index in (0, 2):
        _assert_close(results[index], expected[index], index)
        assert steps[index] == [1, 2, 3, 4]


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


def _layouts(rank: int, world_size: int, model_dir: str) -> dict:
    results = {}
    for name, config in LAYOUTS:
        denoiser = WanDenoiser(model_dir, CPU, torch.float32, parallel=config)
        # Only rank 0 sees the cancellation: the others must follow its decision.
        results[name] = [_batched(denoiser)[0], _batched(denoiser, drop=0 if rank == 0 else None)[0]]
    return results


def test_batches_under_parallel_layouts_equal_one_rank_alone(tiny_model) -> None:
    expected = _alone(WanDenoiser(tiny_model, CPU, torch.float32))
    per_rank = run_ranks(_layouts, 2, str(tiny_model))
    for name, _ in LAYOUTS:
        for rank, results in enumerate(per_rank):
            full, dropped = results[name]
            assert dropped[0] is None, (name, rank)
            for index in range(len(SPECS)):
                _assert_close(full[index], expected[index], (name, rank, index))
                if index:
                    _assert_close(dropped[index], expected[index], (name, rank, index, "after a drop"))


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
