"""FLUX.1's tester config (tests/helpers/feature_mixins/base.py says what a config declares)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
)

from stagekit.denoise import CacheSpec, DenoiseSpec
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.feature_mixins.configs import (
    CFG2,
    HSDP2,
    RING2,
    SEQUENCE_AND_CFG_2,
    TP2,
    TP2_CFG2,
    ULYSSES2,
    ULYSSES2_CFG2,
    USP2X2,
)
from tests.helpers.lora_adapters import FLUX_TARGETS


class FluxTesterConfig(FamilyTesterConfig):
    """FLUX.1-dev: two steps with the embedded guidance and true CFG on top (both branches, so CFG-parallel
    runs), a 12-token T5 sequence and a pooled vector per text. The parallel layouts run 16 packed image tokens
    (64x64) and 15 (48x80, which neither 2 nor 4 divides: padded and masked). The LoRA adapters run `spec`, and
    wrap the final proj_out too (the sequence-parallel plan gathers the image tokens before it)."""

    family = "flux"
    pipeline_class = FluxPipeline
    model_fixture = "flux_model"
    pipeline_fixture = "flux_pipeline"
    transformer_class = FluxTransformer2DModel
    blocks_attribute = "transformer_blocks"
    more_block_lists = ("single_transformer_blocks",)
    expert_names = ("transformer",)
    forwards_per_expert = [4]
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_text_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_text_")
    spec = DenoiseSpec(
        height=48,
        width=80,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=3.0,
        seed=1,
        embedded_guidance_scale=3.5,
    )
    parallel_specs = (
        DenoiseSpec(
            height=64,
            width=64,
            num_frames=1,
            num_inference_steps=2,
            guidance_scale=3.0,
            seed=0,
            embedded_guidance_scale=2.5,
        ),
        spec,
    )
    layerwise_blocks = (1,)
    step_cache_spec = dataclasses.replace(spec, num_inference_steps=8)
    step_caches = (CacheSpec("first_block", 0.5), CacheSpec("mag", 0.3))
    step_cache_layouts = {2: [ULYSSES2, CFG2]}
    parallel_layouts = {2: [ULYSSES2, RING2, CFG2, TP2, HSDP2], 4: [USP2X2, ULYSSES2_CFG2, TP2_CFG2]}
    # Image tokens 16, then 15 with a longer text, then 12 with a shorter one; the embedded guidance alone (one
    # pass a step): true CFG runs the same blocks twice.
    compile_specs = (
        DenoiseSpec(
            height=64,
            width=64,
            num_frames=1,
            num_inference_steps=2,
            guidance_scale=1.0,
            seed=1,
            embedded_guidance_scale=3.5,
        ),
        DenoiseSpec(
            height=48,
            width=80,
            num_frames=1,
            num_inference_steps=2,
            guidance_scale=1.0,
            seed=2,
            embedded_guidance_scale=2.0,
        ),
        DenoiseSpec(
            height=32,
            width=96,
            num_frames=1,
            num_inference_steps=2,
            guidance_scale=1.0,
            seed=3,
            embedded_guidance_scale=3.5,
        ),
    )
    compile_text_lengths = (12, 14, 9)
    lora_spec = spec
    lora_targets = tuple(FLUX_TARGETS)
    lora_layouts = SEQUENCE_AND_CFG_2
    batch_layouts = [ULYSSES2, CFG2, TP2]

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Each text's T5 sequence and CLIP pooled vector, as the text encoder stage sends them."""
        generator = torch.Generator().manual_seed(spec.seed)
        return {
            "prompt_embeds": torch.randn(1, 12, denoiser.text_dim, generator=generator),
            "prompt_pooled_embeds": torch.randn(1, denoiser.pooled_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 12, denoiser.text_dim, generator=generator),
            "negative_prompt_pooled_embeds": torch.randn(1, denoiser.pooled_dim, generator=generator),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        packed, _ = denoiser.initial_noise(self.spec, torch.float32)
        unpacked = FluxPipeline._unpack_latents(packed, self.spec.height, self.spec.width, denoiser.vae_scale_factor)
        return unpacked.unsqueeze(2)

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """FluxPipeline's, with its guidance_scale embedded and true CFG, unpacked to [1, C, 1, h, w]."""
        pipeline.set_progress_bar_config(disable=True)
        conditioning = self.conditioning(denoiser, spec)
        packed = pipeline(
            prompt_embeds=conditioning["prompt_embeds"],
            pooled_prompt_embeds=conditioning["prompt_pooled_embeds"],
            negative_prompt_embeds=conditioning["negative_prompt_embeds"],
            negative_pooled_prompt_embeds=conditioning["negative_prompt_pooled_embeds"],
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.embedded_guidance_scale,
            true_cfg_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
        ).images
        return FluxPipeline._unpack_latents(packed, spec.height, spec.width, pipeline.vae_scale_factor).unsqueeze(2)

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {
            "prompt_embeds": torch.randn(1, self.compile_text_lengths[index], denoiser.text_dim, generator=generator),
            "prompt_pooled_embeds": torch.randn(1, denoiser.pooled_dim, generator=generator),
        }
