"""TeaCache (dit_svc/step_cache/) against its reference algorithm, TeaCache4Wan2.1's rule applied by hand to
Wan's blocks: the steps it skips and the latents it makes. The checks every family's step caches share
(diffusers' hooks, parallel layouts) are StepCacheTesterMixin's, in tests/integration/test_family_features.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dit_svc.denoise import denoise_request
from dit_svc.step_cache.teacache import TEACACHE_COEFFICIENTS, TEACACHE_WARMUP_AFTER_SWITCH, TEACACHE_WARMUP_STEPS
from families.wan.denoise import WanDenoiser
from stagekit.denoise import CacheSpec, DenoiseSpec

CPU = torch.device("cpu")
SPEC = DenoiseSpec(
    height=48,
    width=80,
    num_frames=5,
    num_inference_steps=12,
    guidance_scale=4.0,
    seed=1,
    cache=CacheSpec("teacache", 0.2),
)


def _conditioning(text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
    }


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
    denoiser = WanDenoiser(model_dir, CPU, torch.float32)
    conditioning = _conditioning(denoiser.text_dim)
    latents, passes = denoise_request(denoiser, SPEC, conditioning, lambda s, t: None, lambda: False)

    expected, schedules = _reference_teacache(model_dir, SPEC, conditioning)
    steps = [compute for schedule in schedules for compute in schedule]
    assert not all(steps) and all(schedules[0][:TEACACHE_WARMUP_STEPS]), schedules
    if len(schedules) == 2:
        assert schedules[1] and schedules[1][0], schedules
    assert (passes.run, passes.skipped) == (2 * sum(steps), 2 * steps.count(False))
    assert (latents - expected).abs().max().item() <= 1e-5
