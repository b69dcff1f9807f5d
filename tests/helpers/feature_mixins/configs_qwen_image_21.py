"""The tester config of Qwen-Image 2.1 (tests/helpers/feature_mixins/base.py says what a config declares).

Kept beside configs.py rather than in it, which holds the other families' configs; the package's TESTER_CONFIGS
(tests/helpers/feature_mixins/__init__.py) lists both.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel

from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.feature_mixins.configs import CFG2, TP2, TP2_CFG2

# The (prompt, negative prompt) masks as the text encoder sends them: both texts padded to the longer one, a hole
# in the prompt's (kept after its trailing padding is dropped), the negative prompt's all ones (dropped).
QWEN21_MASKS = ([1, 1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1])
# Each branch on its own rank with the blocks' weights sharded over both; on four ranks, the weights sharded over
# two and replicated twice, every rank running both branches.
HSDP2_CFG2 = ("hsdp2xcfg2", ParallelConfig(cfg_degree=2, use_hsdp=True, hsdp_shard_size=2))
HSDP2X2 = ("hsdp2x2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2))


class QwenImage21TesterConfig(FamilyTesterConfig):
    """Qwen-Image 2.1: two steps with true CFG over 4 x 6 latent tokens (64x96), texts of different lengths with a
    hole in a mask. Each branch fills its KV cache at the first step and reads it at the second, so a CFG-parallel
    rank must keep its own branch's cache. Ulysses and Ring are not built for this model (families/qwen_image_21/
    family.py says why); CFG-parallel, TP and HSDP are its layouts."""

    family = "qwen-image-2.1"
    pipeline_class = QwenImage21Pipeline
    spec = DenoiseSpec(height=64, width=96, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = QwenImage21Transformer2DModel
    blocks_attribute = "transformer_blocks"
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_text_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_text_embed.")
    min_reference_std = 0.1
    parallel_layouts = {2: [CFG2, TP2, HSDP2_CFG2], 4: [TP2_CFG2, HSDP2X2]}

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Both texts with their masks, as the DiT stage receives them; a mask reaches the transformer."""
        generator = torch.Generator().manual_seed(spec.seed)
        prompt_mask, negative_mask = QWEN21_MASKS
        return {
            "prompt_embeds": torch.randn(1, len(prompt_mask), denoiser.text_dim, generator=generator),
            "prompt_embeds_mask": torch.tensor([prompt_mask]),
            "negative_prompt_embeds": torch.randn(1, len(negative_mask), denoiser.text_dim, generator=generator),
            "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        height, width = denoiser.latent_size(self.spec)
        flat = denoiser.initial_noise(self.spec, torch.float32)
        return flat.transpose(1, 2).reshape(1, denoiser.latent_channels, 1, height, width)

    def offloaded_block_lists(self, expert: torch.nn.Module) -> list[list[torch.nn.Module]]:
        """The timestep modulation (a Sequential) and the blocks: each its own groups."""
        return [list(expert.modulation), list(expert.transformer_blocks)]
