"""`--enable-layerwise-offload`: LayerwiseOffloadTesterMixin."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dit_svc.model_options import ModelOptions
from dit_svc.offload import ResidencyCounter, group_offload_units
from tests.helpers.feature_mixins.base import CPU, Reference, denoise_counting


class LayerwiseOffloadTesterMixin:
    """`--enable-layerwise-offload`: the same latents, at most N blocks resident across all experts, for each N
    of the config's `layerwise_blocks`."""

    def test_layerwise_offload_keeps_at_most_n_blocks_resident(
        self: Any, model_dir: Path, reference: Reference, blocks: int
    ) -> None:
        options = ModelOptions(offload="layerwise", offload_blocks=blocks)
        denoiser = self.build_denoiser(model_dir, torch.float32, options)
        expert_lists = [self.offloaded_block_lists(expert) for expert in denoiser.experts]
        expert_blocks = [[block for blocks_list in lists for block in blocks_list] for lists in expert_lists]
        units = [group_offload_units(expert) for expert in denoiser.experts]
        for expert_units, lists in zip(units, expert_lists, strict=True):
            # One group per `blocks` blocks of each list, plus the parameters outside them.
            assert len(expert_units) == sum(math.ceil(len(blocks_list) / blocks) for blocks_list in lists) + 1
        all_blocks = [block for own_blocks in expert_blocks for block in own_blocks]
        counter = ResidencyCounter([unit for expert_units in units for unit in expert_units], all_blocks, CPU)
        assert counter.onloaded == set()

        latents, calls = denoise_counting(self, denoiser)
        difference = (latents - reference.latents).abs().max().item()
        print(
            f"layerwise {blocks} block(s): max abs diff {difference:.2e}, at most {counter.max_resident_blocks} "
            f"blocks resident, {counter.onloads} onloads, expert calls {calls}"
        )
        assert calls == self.forwards_per_expert and torch.equal(latents, reference.latents)
        assert counter.violations == [] and counter.leaf_calls > 0
        # Across all experts at once.
        longest = max(len(blocks_list) for lists in expert_lists for blocks_list in lists)
        assert counter.max_resident_blocks == min(blocks, longest)
        assert counter.onloaded == set()  # offloaded again after each forward
        # Each forward of an expert moves each of its groups once.
        expected = sum(len(expert_units) * n for expert_units, n in zip(units, calls, strict=True))
        assert counter.onloads == counter.offloads == expected
        counter.close()
