"""FLUX.2 klein's tester config (tests/helpers/feature_mixins/base.py says what a config declares)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from diffusers import (
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)

from stagekit.denoise import CacheSpec, DenoiseSpec
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.feature_mixins.configs import (
    CFG2,
    HSDP2,
    HSDP2X2_ULYSSES2_CFG2,
    RING2,
    SEQUENCE_AND_CFG_2,
    TP2,
    TP2_RING2,
    ULYSSES2,
    USP2X2,
)
from tests.helpers.lora_adapters import FLUX2_TARGETS


class Flux2KleinTesterConfig(FamilyTesterConfig):
    """FLUX.2 klein, its base kind (tiny-base: not distilled), so that CFG runs: two steps with CFG over 15 packed
    image tokens (48x80: 3 x 5, which neither 2 nor 4 divides) and two texts of 24 tokens. The distilled kind's
    loop is the same without the negative branch (tests/integration/test_family_flux2_klein.py)."""

    family = "flux2-klein"
    pipeline_class = Flux2KleinPipeline
    model_fixture = "klein_base_model"
    pipeline_fixture = "klein_base_pipeline"
    spec = DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = Flux2Transformer2DModel
    blocks_attribute = "transformer_blocks"
    more_block_lists = ("single_transformer_blocks",)
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_guidance_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_guidance_embed.")
    min_reference_std = 0.1
    step_cache_spec = dataclasses.replace(spec, num_inference_steps=8)
    # MagCache only: diffusers' FirstBlockCache cannot run Flux2 (its tail hook takes the single-stream blocks'
    # fused [text; image] output for the double-stream blocks' pair).
    step_caches = (CacheSpec("mag", 0.3),)
    step_cache_layouts = {2: SEQUENCE_AND_CFG_2}
    parallel_layouts = {2: [ULYSSES2, RING2, CFG2, TP2, HSDP2], 4: [USP2X2, TP2_RING2, HSDP2X2_ULYSSES2_CFG2]}
    lora_spec = spec
    # Image tokens 15, then 24 with a longer text, then 8 with a shorter one; without CFG, whose second branch
    # runs the same blocks again.
    compile_specs = (
        dataclasses.replace(spec, guidance_scale=1.0),
        DenoiseSpec(height=64, width=96, num_frames=1, num_inference_steps=2, guidance_scale=1.0, seed=1),
        DenoiseSpec(height=32, width=64, num_frames=1, num_inference_steps=2, guidance_scale=1.0, seed=2),
    )
    compile_text_lengths = (24, 30, 18)
    lora_targets = tuple(FLUX2_TARGETS)
    lora_layouts = SEQUENCE_AND_CFG_2

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(spec.seed)
        return {
            "prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
        }

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        shape = (1, self.compile_text_lengths[index], denoiser.text_dim)
        return {
            "prompt_embeds": torch.randn(shape, generator=generator),
            "negative_prompt_embeds": torch.randn(shape, generator=generator),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        packed, ids = denoiser.initial_noise(self.spec, torch.float32)
        height, width = denoiser.latent_size(self.spec)
        return Flux2KleinPipeline._unpack_latents_with_ids(packed, ids, height, width).unsqueeze(2)

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """Flux2KleinPipeline's final latents of `spec` with the config's texts, taken packed at its last step (before
        it de-normalises them) and laid out as the denoiser returns them: [1, 4C, 1, h, w]."""
        conditioning = self.conditioning(denoiser, spec)
        final: dict[str, torch.Tensor] = {}

        def keep(pipe: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            final["latents"] = tensors["latents"]
            return tensors

        pipeline.set_progress_bar_config(disable=True)
        pipeline(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
            callback_on_step_end=keep,
            **conditioning,
        )
        _, ids = denoiser.initial_noise(spec, torch.float32)
        height, width = denoiser.latent_size(spec)
        return Flux2KleinPipeline._unpack_latents_with_ids(final["latents"], ids, height, width).unsqueeze(2)
