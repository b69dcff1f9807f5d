"""Step caches (`cache.method first_block`, `mag`, `teacache`; dit_svc/step_cache/): StepCacheTesterMixin.

A config declares the request its caches run (`step_cache_spec`, enough steps to skip some), the caches with
their thresholds (`step_caches`, the methods the family offers) and the layouts to run them under
(`step_cache_layouts`). One rank's run of each cache is made once per checkpoint and shared by the checks;
MagCache runs with the ratios a calibration run of the same request recorded for each expert's prompt branch.
As for the parallel layouts, each world size is spawned once per session, for every config collected with
this mixin.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, apply_first_block_cache, apply_mag_cache
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import HookRegistry
from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK

from dit_svc.denoise import denoise_request
from dit_svc.step_cache import CachePasses
from stagekit.denoise import CacheSpec
from tests.helpers.feature_mixins.base import FamilyTesterConfig, SpawnResults, checkpoint, shared_spawn, tester_config

TOLERANCE = 1e-4
# The caches diffusers' hooks implement, with the names their hooks are registered under.
DIFFUSERS_HOOKS = {
    "first_block": (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK),
    "mag": (_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK),
}

Run = tuple[torch.Tensor, CachePasses]


@dataclasses.dataclass
class OneRank:
    """One rank's runs of a config's step caches: the calibration (when MagCache is among them), the ratios it
    gives each expert, and each of `step_caches` in order."""

    calibration: dict[str, dict[str, list[float]]]
    calibrated: Run | None
    mag_ratios: dict[str, list[float]] | None
    runs: list[Run]


_ONE_RANK: dict[tuple[str, str], OneRank] = {}
_PER_RANK: SpawnResults = {}


def cache_run(config: FamilyTesterConfig, denoiser: Any, cache: CacheSpec, **mag: Any) -> Run:
    """The latents and passes of the config's `step_cache_spec` with `cache`, as the DiT stage runs a request."""
    spec = dataclasses.replace(config.step_cache_spec, cache=cache)
    conditioning = config.conditioning(denoiser, spec)
    return denoise_request(denoiser, spec, conditioning, lambda step, total: None, lambda: False, **mag)


def one_rank_runs(config: FamilyTesterConfig, model_dir: Path, denoiser: Any | None = None) -> OneRank:
    """The config's `OneRank`, once per checkpoint."""
    key = (config.family, str(model_dir))
    if key not in _ONE_RANK:
        denoiser = denoiser or config.build_denoiser(model_dir, torch.float32)
        calibration: dict[str, dict[str, list[float]]] = {}
        calibrated, mag_ratios = None, None
        if any(cache.method == "mag" for cache in config.step_caches):
            calibrated = cache_run(config, denoiser, CacheSpec("mag", 1.0), calibration=calibration)
            mag_ratios = {name: calibration[name]["cond"] for name in config.expert_names}
        runs = [cache_run(config, denoiser, cache, mag_ratios=mag_ratios) for cache in config.step_caches]
        _ONE_RANK[key] = OneRank(calibration, calibrated, mag_ratios, runs)
    return _ONE_RANK[key]


def _rank_runs(
    rank: int, world_size: int, cases: list[tuple[type[FamilyTesterConfig], str, dict[str, list[float]] | None]]
) -> dict[str, dict[str, list[Run]]]:
    """On one rank: by config and layout name, the run of each of the config's caches under that layout."""
    results = {}
    for config_class, model_dir, mag_ratios in cases:
        config = config_class()
        results[config_class.__qualname__] = {}
        for name, layout in config.step_cache_layouts[world_size]:
            denoiser = config.build_denoiser(Path(model_dir), torch.float32, parallel=layout)
            runs = [cache_run(config, denoiser, cache, mag_ratios=mag_ratios) for cache in config.step_caches]
            results[config_class.__qualname__][name] = runs
    return results


def per_rank_runs(
    request: pytest.FixtureRequest, config: type[FamilyTesterConfig], world_size: int
) -> list[dict[str, list[Run]]]:
    """Every rank's runs of the config's caches under its layouts of `world_size`, by layout name (one spawn
    per size); MagCache runs with one rank's calibrated ratios."""

    def case(each: type[FamilyTesterConfig]) -> tuple[Any, ...]:
        model_dir = checkpoint(each, request)
        return (each, str(model_dir), one_rank_runs(each(), model_dir).mag_ratios)

    return shared_spawn(
        request,
        config,
        world_size,
        mixin=StepCacheTesterMixin,
        layouts="step_cache_layouts",
        results=_PER_RANK,
        case=case,
        rank_function=_rank_runs,
    )


def with_diffusers_hooks(
    config: FamilyTesterConfig, denoiser: Any, cache: CacheSpec, one_rank: OneRank
) -> torch.Tensor:
    """The latents of the config's request uncached, with diffusers' hooks of `cache` on every expert, which
    are removed after."""
    for name, expert in zip(config.expert_names, denoiser.experts, strict=True):
        if cache.method == "first_block":
            apply_first_block_cache(expert, FirstBlockCacheConfig(threshold=cache.threshold))
        else:
            assert one_rank.mag_ratios is not None
            steps = config.step_cache_spec.num_inference_steps
            mag = MagCacheConfig(
                threshold=cache.threshold, num_inference_steps=steps, mag_ratios=one_rank.mag_ratios[name]
            )
            apply_mag_cache(expert, mag)
    spec = config.step_cache_spec
    try:
        return denoiser.denoise(spec, config.conditioning(denoiser, spec), lambda step, total: None, lambda: False)
    finally:
        for expert in denoiser.experts:
            registry = HookRegistry.check_if_exists_or_initialize(expert)
            for hook in DIFFUSERS_HOOKS[cache.method]:
                registry.remove_hook(hook, recurse=True)
            registry.invalidate_child_registries_cache()


class StepCacheTesterMixin:
    """`cache.method` of a request: on one rank every cache of the config's `step_caches` skips some passes
    and runs others, and the first-block cache and MagCache equal diffusers' hooks on every expert (each
    expert with its own state), their hooks coming off after the request; MagCache's calibration records one
    ratio per step of each branch and skips nothing. Under every layout of `step_cache_layouts` each rank
    skips the passes one rank skips, to the same latents within TOLERANCE."""

    def test_step_caches_equal_diffusers_hooks(self: Any, model_dir: Path) -> None:
        denoiser = self.build_denoiser(model_dir, torch.float32)
        one_rank = one_rank_runs(self, model_dir, denoiser)
        steps = self.step_cache_spec.num_inference_steps
        for cache, (latents, passes) in zip(self.step_caches, one_rank.runs, strict=True):
            print(f"{self.family} {cache.method} {cache.threshold}: {passes}")
            assert passes.run > 0 and passes.skipped > 0, (cache, passes)
            assert passes.run + passes.skipped == 2 * steps, (cache, passes)
            if cache.method in DIFFUSERS_HOOKS:
                assert torch.equal(latents, with_diffusers_hooks(self, denoiser, cache, one_rank)), cache
        # The caches' hooks come off after each request: the next one runs every pass.
        uncached, passes = cache_run(self, denoiser, CacheSpec())
        assert passes.skipped == 0
        assert not any(torch.equal(uncached, latents) for latents, _ in one_rank.runs)
        if one_rank.calibrated is not None:
            calibrated, passes = one_rank.calibrated
            assert passes.skipped == 0 and torch.equal(calibrated, uncached)
            lengths = {
                name: {branch: len(r) for branch, r in one_rank.calibration[name].items()} for name in self.expert_names
            }
            assert lengths == {name: {"cond": steps, "uncond": steps} for name in self.expert_names}, lengths

    def test_step_caches_under_parallel_layouts_equal_one_rank(
        self: Any, request: pytest.FixtureRequest, model_dir: Path, cache_world_size: int
    ) -> None:
        expected = one_rank_runs(self, model_dir).runs
        per_rank = per_rank_runs(request, tester_config(type(self)), cache_world_size)
        for name, _ in self.step_cache_layouts[cache_world_size]:
            for rank, results in enumerate(per_rank):
                for cache, (latents, passes), (want, want_passes) in zip(
                    self.step_caches, results[name], expected, strict=True
                ):
                    difference = (latents - want).abs().max().item()
                    print(f"{self.family} {name} {cache.method} rank {rank}: {passes} max abs diff {difference:.2e}")
                    assert passes == want_passes, (name, cache, rank, passes, want_passes)
                    assert difference <= TOLERANCE, (name, cache, rank, difference)
