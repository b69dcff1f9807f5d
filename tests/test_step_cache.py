"""Step caches (dit_svc/step_cache.py): on one rank equal to diffusers' hooks on the same transformer, and
under sequence and CFG parallelism equal to one rank, with the same passes skipped on every rank."""

from __future__ import annotations

import dataclasses

import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import HookRegistry

from dit_svc.denoise import DenoiseSpec, denoise_request
from dit_svc.parallel import ParallelConfig
from dit_svc.parallel.launch import run_ranks
from dit_svc.step_cache import CacheSpec
from families.wan.denoise import WanDenoiser

TOLERANCE = 1e-4
CPU = torch.device("cpu")
# 30 tokens: not divisible by 2 x 2, so the first-block statistics leave padding out.
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=8, guidance_scale=4.0, seed=1)
CACHES = [CacheSpec("first_block", 0.2), CacheSpec("teacache", 0.2)]
LAYOUTS_2 = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("ring2", ParallelConfig(ring_degree=2)),
    ("cfg2", ParallelConfig(cfg_degree=2)),
]


def _conditioning(text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
    }


def _run(denoiser, cache: CacheSpec):
    spec = dataclasses.replace(SPEC, cache=cache)
    return denoise_request(denoiser, spec, _conditioning(denoiser.text_dim), lambda s, t: None, lambda: False)


def test_first_block_cache_equals_diffusers_hooks(tiny_model) -> None:
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    latents, passes = _run(denoiser, CacheSpec("first_block", 0.2))
    assert passes.run > 0 and passes.skipped > 0, passes
    assert passes.run + passes.skipped == 2 * SPEC.num_inference_steps
    apply_first_block_cache(denoiser.transformer, FirstBlockCacheConfig(threshold=0.2))
    try:
        reference = denoiser.denoise(SPEC, _conditioning(denoiser.text_dim), lambda s, t: None, lambda: False)
    finally:
        registry = HookRegistry.check_if_exists_or_initialize(denoiser.transformer)
        registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
        registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
    assert torch.equal(latents, reference)
    # The hooks come off after the request: the next one runs every pass.
    uncached, passes = _run(denoiser, CacheSpec())
    assert passes.skipped == 0 and not torch.equal(uncached, latents)


def _run_layouts(rank: int, world_size: int, model_dir: str, layouts) -> dict:
    results = {}
    for name, config in layouts:
        denoiser = WanDenoiser(model_dir, CPU, torch.float32, parallel=config)
        results[name] = [_run(denoiser, cache) for cache in CACHES]
    return results


def test_caches_under_parallel_layouts_equal_one_rank(tiny_model) -> None:
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    expected = [_run(denoiser, cache) for cache in CACHES]
    for _, passes in expected:
        assert passes.skipped > 0 and passes.run > 0, passes
    per_rank = run_ranks(_run_layouts, 2, str(tiny_model), LAYOUTS_2)
    for name, _ in LAYOUTS_2:
        for rank, results in enumerate(per_rank):
            for cache, (latents, passes), (want, want_passes) in zip(CACHES, results[name], expected, strict=True):
                difference = (latents - want).abs().max().item()
                print(f"{name} {cache.method} rank {rank}: {passes} max abs diff {difference:.2e}")
                assert passes == want_passes, (name, cache, rank)
                assert difference <= TOLERANCE, (name, cache, rank, difference)
