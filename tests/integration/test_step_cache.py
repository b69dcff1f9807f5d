"""Step caches (dit_svc/step_cache/): on one rank equal to diffusers' hooks on the same transformer, and
under sequence and CFG parallelism equal to one rank, with the same passes skipped on every rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, apply_first_block_cache, apply_mag_cache
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import HookRegistry
from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK

from dit_svc.denoise import denoise_request
from dit_svc.step_cache import TEACACHE_COEFFICIENTS, TEACACHE_WARMUP_AFTER_SWITCH, TEACACHE_WARMUP_STEPS
from families.qwen_image.denoise import QwenImageDenoiser
from families.wan.denoise import WanDenoiser
from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks

TOLERANCE = 1e-4
CPU = torch.device("cpu")
# 30 tokens: not divisible by 2 x 2, so the first-block statistics leave padding out.
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=8, guidance_scale=4.0, seed=1)
CACHES = [CacheSpec("first_block", 0.2), CacheSpec("teacache", 0.2), CacheSpec("mag", 0.3)]
LAYOUTS_2 = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("ring2", ParallelConfig(ring_degree=2)),
    ("cfg2", ParallelConfig(cfg_degree=2)),
]
LAYOUTS_4 = [
    ("usp2x2", ParallelConfig(ulysses_degree=2, ring_degree=2)),
    ("ulysses2xcfg2", ParallelConfig(ulysses_degree=2, cfg_degree=2)),
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


def _with_diffusers_hooks(
    denoiser, hook_names: tuple[str, str], spec: DenoiseSpec = SPEC, conditioning: dict | None = None
) -> torch.Tensor:
    """The latents of `spec` with the hooks diffusers applied to every expert, which are removed after."""
    conditioning = conditioning if conditioning is not None else _conditioning(denoiser.text_dim)
    try:
        return denoiser.denoise(spec, conditioning, lambda s, t: None, lambda: False)
    finally:
        for expert in denoiser.experts:
            registry = HookRegistry.check_if_exists_or_initialize(expert)
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


class _ReferenceTeaCacheBlocks(torch.nn.Module):
    """The reference's residual reuse, written out: the transformer's blocks as one module that, on a pass the
    schedule skips, adds the residual its branch's blocks added on their last full pass."""

    def __init__(self, blocks: torch.nn.ModuleList, schedule: list[bool]) -> None:
        super().__init__()
        self.inner = blocks
        self.schedule = schedule
        self.calls = 0
        self.residual: dict[int, torch.Tensor] = {}

    def forward(self, hidden_states, *args):
        step, branch = divmod(self.calls, 2)  # WanDenoiser runs the prompt's pass, then the negative prompt's
        self.calls += 1
        if not self.schedule[step]:
            return hidden_states + self.residual[branch]
        output = hidden_states
        for block in self.inner:
            output = block(output, *args)
        self.residual[branch] = output - hidden_states
        return output


def _reference_teacache_schedules(denoiser, spec: DenoiseSpec, prompt_embeds: torch.Tensor) -> list[list[bool]]:
    """Per expert, which of its steps run in full, by TeaCache4Wan2.1's use_ret_steps rule: the timestep
    modulation's relative L1 change, rescaled by the published polynomial (a narrow model takes the 1.3B one)
    and accumulated until it reaches the threshold; the first five steps always run, and a second expert
    starts afresh with one. Both branches see the same timesteps, so they share the schedule."""
    scheduler = denoiser.scheduler_class.from_config(denoiser.scheduler_config)
    scheduler.set_timesteps(spec.num_inference_steps)
    boundary = None if denoiser.boundary_ratio is None else denoiser.boundary_ratio * 1000
    rescale = np.poly1d(TEACACHE_COEFFICIENTS["Wan2.1-T2V-1.3B"])
    experts = denoiser.experts
    schedules: list[list[bool]] = [[] for _ in experts]
    accumulated, previous = [0.0] * len(experts), [None] * len(experts)
    for t in scheduler.timesteps:
        index = experts.index(denoiser.expert_for(t, boundary))
        modulation = experts[index].condition_embedder(t.expand(1), prompt_embeds)[1]
        warmup = TEACACHE_WARMUP_STEPS if index == 0 else TEACACHE_WARMUP_AFTER_SWITCH
        compute = True
        if len(schedules[index]) >= warmup:
            change = (modulation - previous[index]).abs().mean() / previous[index].abs().mean()
            accumulated[index] += rescale(change.item())
            compute = accumulated[index] >= spec.cache.threshold
        if compute:
            accumulated[index] = 0.0
        schedules[index].append(compute)
        previous[index] = modulation
    return schedules


def _reference_teacache(model_dir, spec: DenoiseSpec, conditioning) -> tuple[torch.Tensor, list[list[bool]]]:
    """The latents of `spec` with each expert's blocks skipped by hand on the reference's schedule."""
    reference = WanDenoiser(model_dir, CPU, torch.float32)
    schedules = _reference_teacache_schedules(reference, spec, conditioning["prompt_embeds"])
    for expert, schedule in zip(reference.experts, schedules, strict=True):
        expert.blocks = torch.nn.ModuleList([_ReferenceTeaCacheBlocks(expert.blocks, schedule)])
    uncached = dataclasses.replace(spec, cache=CacheSpec())
    return reference.denoise(uncached, conditioning, lambda s, t: None, lambda: False), schedules


@torch.no_grad()
@pytest.mark.parametrize("model", ["tiny_model", "a14b_model"])
def test_teacache_follows_the_reference_algorithm(model, request) -> None:
    """The steps TeaCache skips and the latents it makes equal the reference rule applied by hand; with two
    experts (Wan2.2 A14B) the cache resets at the switch: the second expert's first step runs in full."""
    model_dir = request.getfixturevalue(model)
    spec = dataclasses.replace(SPEC, num_inference_steps=12, cache=CacheSpec("teacache", 0.2))
    denoiser = WanDenoiser(model_dir, CPU, torch.float32)
    conditioning = _conditioning(denoiser.text_dim)
    latents, passes = denoise_request(denoiser, spec, conditioning, lambda s, t: None, lambda: False)

    expected, schedules = _reference_teacache(model_dir, spec, conditioning)
    steps = [compute for schedule in schedules for compute in schedule]
    assert not all(steps) and all(schedules[0][:TEACACHE_WARMUP_STEPS]), schedules
    if len(schedules) == 2:
        assert schedules[1] and schedules[1][0], schedules
    assert (passes.run, passes.skipped) == (2 * sum(steps), 2 * steps.count(False))
    assert (latents - expected).abs().max().item() <= 1e-5


def _run_layouts(rank: int, world_size: int, model_dir: str, layouts, mag_ratios) -> dict:
    results = {}
    for name, config in layouts:
        denoiser = WanDenoiser(model_dir, CPU, torch.float32, parallel=config)
        results[name] = [_run(denoiser, cache, mag_ratios=mag_ratios) for cache in CACHES]
    return results


def _check_layouts(per_rank: list[dict], layouts, expected, caches=CACHES, model: str = "wan") -> None:
    """Every rank of every layout skipped the passes one rank skips, and its latents are within TOLERANCE."""
    for name, _ in layouts:
        for rank, results in enumerate(per_rank):
            for cache, (latents, passes), (want, want_passes) in zip(caches, results[name], expected, strict=True):
                difference = (latents - want).abs().max().item()
                print(f"{model} {name} {cache.method} rank {rank}: {passes} max abs diff {difference:.2e}")
                assert passes == want_passes, (name, cache, rank)
                assert difference <= TOLERANCE, (name, cache, rank, difference)


def test_caches_under_parallel_layouts_equal_one_rank(tiny_model) -> None:
    """Every cache under ulysses2, ring2 and cfg2, then usp2x2 and ulysses2 x cfg2 on four ranks: the same
    passes skipped on every rank as on one, and the same latents within 1e-4."""
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32)
    calibration: dict = {}
    _run(denoiser, CacheSpec("mag", 1.0), calibration=calibration)
    mag_ratios = {"transformer": calibration["transformer"]["cond"]}
    expected = [_run(denoiser, cache, mag_ratios=mag_ratios) for cache in CACHES]
    for _, passes in expected:
        assert passes.skipped > 0 and passes.run > 0, passes
    _check_layouts(run_ranks(_run_layouts, 2, str(tiny_model), LAYOUTS_2, mag_ratios), LAYOUTS_2, expected)
    _check_layouts(run_ranks(_run_layouts, 4, str(tiny_model), LAYOUTS_4, mag_ratios), LAYOUTS_4, expected)


# Qwen-Image: 48x80 -> 15 packed image tokens (no degree divides them); texts of different lengths.
QWEN_SPEC = DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=8, guidance_scale=4.0, seed=1)
QWEN_CACHES = [CacheSpec("first_block", 0.5), CacheSpec("mag", 0.3)]


def _qwen_conditioning(dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(1, 7, dim, generator=generator),
        "prompt_embeds_mask": torch.ones(1, 7, dtype=torch.int64),
        "negative_prompt_embeds": torch.randn(1, 5, dim, generator=generator),
        "negative_prompt_embeds_mask": torch.ones(1, 5, dtype=torch.int64),
    }


def _qwen_run(denoiser, cache: CacheSpec, **mag):
    spec = dataclasses.replace(QWEN_SPEC, cache=cache)
    conditioning = _qwen_conditioning(denoiser.text_dim)
    return denoise_request(denoiser, spec, conditioning, lambda s, t: None, lambda: False, **mag)


def _qwen_layouts(rank: int, world_size: int, model_dir: str, mag_ratios) -> dict:
    results = {}
    for name, config in LAYOUTS_2:
        denoiser = QwenImageDenoiser(model_dir, CPU, torch.float32, parallel=config)
        results[name] = [_qwen_run(denoiser, cache, mag_ratios=mag_ratios) for cache in QWEN_CACHES]
    return results


def test_qwen_caches_equal_diffusers_hooks_and_one_rank(qwen_model) -> None:
    """Qwen-Image's blocks return the text and image streams; the caches skip on the image stream's
    residual as diffusers' hooks do, and under ulysses2, ring2 and cfg2 every rank skips what one rank does."""
    denoiser = QwenImageDenoiser(qwen_model, CPU, torch.float32)
    calibration: dict = {}
    _qwen_run(denoiser, CacheSpec("mag", 1.0), calibration=calibration)
    mag_ratios = {"transformer": calibration["transformer"]["cond"]}
    expected = [_qwen_run(denoiser, cache, mag_ratios=mag_ratios) for cache in QWEN_CACHES]
    conditioning = _qwen_conditioning(denoiser.text_dim)
    for cache, (latents, passes) in zip(QWEN_CACHES, expected, strict=True):
        assert passes.run > 0 and passes.skipped > 0, (cache, passes)
        if cache.method == "first_block":
            apply_first_block_cache(denoiser.transformer, FirstBlockCacheConfig(threshold=cache.threshold))
            names = (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK)
        else:
            config = MagCacheConfig(
                threshold=cache.threshold, num_inference_steps=8, mag_ratios=mag_ratios["transformer"]
            )
            apply_mag_cache(denoiser.transformer, config)
            names = (_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK)
        reference = _with_diffusers_hooks(denoiser, names, QWEN_SPEC, conditioning)
        assert torch.equal(latents, reference), cache
    per_rank = run_ranks(_qwen_layouts, 2, str(qwen_model), mag_ratios)
    _check_layouts(per_rank, LAYOUTS_2, expected, QWEN_CACHES, "qwen")


A14B_CACHES = [CacheSpec("first_block", 0.2), CacheSpec("teacache", 0.2)]
A14B_LAYOUTS = [("ulysses2", ParallelConfig(ulysses_degree=2)), ("cfg2", ParallelConfig(cfg_degree=2))]


def _a14b_layouts(rank: int, world_size: int, model_dir: str) -> dict:
    results = {}
    for name, config in A14B_LAYOUTS:
        denoiser = WanDenoiser(model_dir, CPU, torch.float32, parallel=config)
        results[name] = [_run(denoiser, cache) for cache in A14B_CACHES]
    return results


def test_a14b_caches_keep_one_state_per_expert(a14b_model) -> None:
    """Wan2.2 A14B: the first-block cache equals diffusers' hooks on both experts (each with its own state, so
    the second expert's first step runs in full), and under ulysses2 and cfg2 every rank equals one rank."""
    denoiser = WanDenoiser(a14b_model, CPU, torch.float32)
    assert len(denoiser.experts) == 2
    expected = [_run(denoiser, cache) for cache in A14B_CACHES]
    latents, passes = expected[0]
    assert passes.run > 0 and passes.skipped > 0, passes
    for expert in denoiser.experts:
        apply_first_block_cache(expert, FirstBlockCacheConfig(threshold=0.2))
    assert torch.equal(latents, _with_diffusers_hooks(denoiser, (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK)))
    per_rank = run_ranks(_a14b_layouts, 2, str(a14b_model))
    _check_layouts(per_rank, A14B_LAYOUTS, expected, A14B_CACHES, "a14b")
