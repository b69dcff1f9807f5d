"""Step caches (dit_svc/step_cache.py): on one rank equal to diffusers' hooks on the same transformer, and
under sequence and CFG parallelism equal to one rank, with the same passes skipped on every rank."""

from __future__ import annotations

import dataclasses

import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, apply_first_block_cache, apply_mag_cache
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import HookRegistry
from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK

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


def _run(denoiser, cache: CacheSpec, **mag):
    spec = dataclasses.replace(SPEC, cache=cache)
    return denoise_request(denoiser, spec, _conditioning(denoiser.text_dim), lambda s, t: None, lambda: False, **mag)


def _with_diffusers_hooks(denoiser, hook_names: tuple[str, str]) -> torch.Tensor:
    """The latents of SPEC with hooks that diffusers applied, which are removed after."""
    try:
        return denoiser.denoise(SPEC, _conditioning(denoiser.text_dim), lambda s, t: None, lambda: False)
    finally:
        registry = HookRegistry.check_if_exists_or_initialize(denoiser.transformer)
        for name in hook_names:
            registry.remove_hook(name, recurse=True)
        registry.invalidate_child_registries_cache()


def test_first_block_cache_equals_diffusers_hooks(tiny_model) -> None:
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    latents, passes = _run(denoiser, CacheSpec("first_block", 0.2))
    assert passes.run > 0 and passes.skipped > 0, passes
    assert passes.run + passes.skipped == 2 * SPEC.num_inference_steps
    apply_first_block_cache(denoiser.transformer, FirstBlockCacheConfig(threshold=0.2))
    reference = _with_diffusers_hooks(denoiser, (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK))
    assert torch.equal(latents, reference)
    # The hooks come off after the request: the next one runs every pass.
    uncached, passes = _run(denoiser, CacheSpec())
    assert passes.skipped == 0 and not torch.equal(uncached, latents)


def test_mag_cache_equals_diffusers_hooks(tiny_model) -> None:
    """Calibration records one ratio per step of each branch and skips nothing; with the prompt branch's
    ratios, MagCache skips what diffusers' own hooks skip, to the same latents."""
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    calibration: dict = {}
    calibrated, passes = _run(denoiser, CacheSpec("mag", 1.0), calibration=calibration)
    assert passes.skipped == 0
    assert {branch: len(r) for branch, r in calibration["transformer"].items()} == {"cond": 8, "uncond": 8}
    assert torch.equal(calibrated, _run(denoiser, CacheSpec())[0])
    ratios = {"transformer": calibration["transformer"]["cond"]}
    latents, passes = _run(denoiser, CacheSpec("mag", 0.3), mag_ratios=ratios)
    assert passes.run > 0 and passes.skipped > 0, passes
    config = MagCacheConfig(threshold=0.3, num_inference_steps=8, mag_ratios=ratios["transformer"])
    apply_mag_cache(denoiser.transformer, config)
    reference = _with_diffusers_hooks(denoiser, (_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK))
    assert torch.equal(latents, reference)


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
