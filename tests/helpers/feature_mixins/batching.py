"""`--max-batch-size`: BatchingTesterMixin."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from stagekit.denoise import DenoiseSpec

TOLERANCE = 1e-4
# (seed, guidance scale) of each request of the batch: everything a batch may mix (each seed its own prompt).
MEMBERS = ((1, 4.0), (2, 5.5), (3, 3.7))


def batch_specs(spec: DenoiseSpec) -> list[DenoiseSpec]:
    """The requests of a test batch: `spec` with each member's seed and guidance scale, and for a
    guidance-distilled model (`embedded_guidance_scale` set) each member's own embedded guidance too."""
    specs = []
    for index, (seed, scale) in enumerate(MEMBERS):
        embedded = spec.embedded_guidance_scale
        if embedded is not None:
            embedded += index
        specs.append(dataclasses.replace(spec, seed=seed, guidance_scale=scale, embedded_guidance_scale=embedded))
    return specs


class BatchingTesterMixin:
    """`--max-batch-size`: each request of a batch (its own seed, prompt and guidance scales on the config's
    request) gets the latents it gets alone, and is told of every step; a member dropped between steps stops
    there and leaves the others unchanged."""

    def test_each_request_of_a_batch_gets_its_own_latents(self: Any, model_dir: Path) -> None:
        denoiser = self.build_denoiser(model_dir, torch.float32)
        specs = batch_specs(self.spec)
        conditionings = [self.conditioning(denoiser, spec) for spec in specs]
        alone = [
            denoiser.denoise(spec, conditioning, lambda step, total: None, lambda: False)
            for spec, conditioning in zip(specs, conditionings, strict=True)
        ]
        steps: list[list[int]] = [[] for _ in specs]
        batched = denoiser.denoise_batch(
            specs,
            conditionings,
            lambda member, step, total: steps[member].append(step),
            lambda: [True] * len(specs),
        )
        for index, (got, want) in enumerate(zip(batched, alone, strict=True)):
            difference = (got - want).abs().max().item()
            print(f"member {index}: max abs diff {difference:.2e} from its run alone")
            assert difference <= TOLERANCE, f"member {index}: max abs difference {difference:.2e}"
        assert steps == [list(range(1, self.spec.num_inference_steps + 1))] * len(specs)

    def test_a_dropped_member_stops_and_leaves_the_others_unchanged(self: Any, model_dir: Path) -> None:
        denoiser = self.build_denoiser(model_dir, torch.float32)
        specs = batch_specs(self.spec)
        conditionings = [self.conditioning(denoiser, spec) for spec in specs]
        full = denoiser.denoise_batch(specs, conditionings, lambda member, step, total: None, lambda: [True] * 3)
        steps: list[list[int]] = [[] for _ in specs]
        batched = denoiser.denoise_batch(
            specs,
            conditionings,
            lambda member, step, total: steps[member].append(step),
            lambda: [True, not steps[1], True],  # member 1 leaves after its first step
        )
        assert batched[1] is None and steps[1] == [1]
        for index in (0, 2):
            difference = (batched[index] - full[index]).abs().max().item()
            assert difference <= TOLERANCE, f"member {index}: max abs difference {difference:.2e} after the drop"
            assert steps[index] == list(range(1, self.spec.num_inference_steps + 1))
