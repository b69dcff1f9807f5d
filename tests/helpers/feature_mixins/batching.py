"""`--max-batch-size`: BatchingTesterMixin."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 1e-4
# (seed, guidance scale) of each request of the batch: everything a batch may mix (each seed its own prompt).
MEMBERS = ((1, 4.0), (2, 5.5), (3, 3.7))


class BatchingTesterMixin:
    """`--max-batch-size`: each request of a batch (its own seed, prompt and guidance scale on the config's
    request) gets the latents it gets alone, and is told of every step."""

    def test_each_request_of_a_batch_gets_its_own_latents(self: Any, model_dir: Path) -> None:
        denoiser = self.build_denoiser(model_dir, torch.float32)
        specs = [dataclasses.replace(self.spec, seed=seed, guidance_scale=scale) for seed, scale in MEMBERS]
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
