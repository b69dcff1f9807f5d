"""HunyuanVideo 1.5's tester config (tests/helpers/feature_mixins/base.py says what a config declares)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from diffusers import HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
from diffusers.guiders import ClassifierFreeGuidance

from stagekit.denoise import DenoiseSpec
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.feature_mixins.configs import (
    CFG2,
    HSDP2,
    HSDP2X2_ULYSSES2_CFG2,
    RING2,
    TP2,
    TP2_RING2,
    ULYSSES2,
    USP2X2,
)

# The (prompt, negative prompt) masks of each encoder as the text encoder sends them: both texts padded to the
# longer one; the prompt has glyph text, the negative prompt none (one masked row in the batch's padding).
TEXT_MASKS = ([1] * 7 + [0, 0], [1] * 9)
GLYPH_MASKS = ([1] * 5, [0] * 5)


class HunyuanVideo15TesterConfig(FamilyTesterConfig):
    """HunyuanVideo 1.5 text-to-video: two steps with CFG; the layouts run 45 video tokens (48x80x9: 3 x 3 x 5,
    which 2 and 4 do not divide) and 32 (64x64x5: 2 x 4 x 4), the text whole on every rank with its masks."""

    family = "hunyuanvideo-1.5"
    pipeline_class = HunyuanVideo15Pipeline
    spec = DenoiseSpec(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=6.0, seed=0)
    parallel_specs = (
        spec,
        DenoiseSpec(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1),
    )
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = HunyuanVideo15Transformer3DModel
    blocks_attribute = "transformer_blocks"
    more_repeated_modules = ("x_embedder", "context_embedder")
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_embed.")
    min_reference_std = 0.1
    parallel_layouts = {2: [ULYSSES2, RING2, CFG2, TP2, HSDP2], 4: [USP2X2, TP2_RING2, HSDP2X2_ULYSSES2_CFG2]}
    # TP leaves the ByT5 projection whole: its 2048-wide MLP (a width fixed in diffusers) is 90% of this tiny model's
    # parameters (0.06% of the published 8.3B), so a TP rank holds 98.6% of them here.
    max_sharded_fraction = 0.99

    # Video tokens 45, then 32, then 24 and 60 with other text lengths (compile_text_lengths); each with CFG.
    compile_specs = (
        spec,
        DenoiseSpec(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1),
        DenoiseSpec(height=32, width=48, num_frames=13, num_inference_steps=2, guidance_scale=5.0, seed=2),
        DenoiseSpec(height=48, width=80, num_frames=13, num_inference_steps=2, guidance_scale=3.0, seed=3),
    )
    # (Qwen2.5-VL tokens, ByT5 tokens) of the prompt of each compile spec; the negative prompt's are fixed.
    compile_text_lengths = ((9, 5), (14, 3), (6, 8), (20, 1))

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Both texts of both encoders with their masks, as the DiT stage receives them."""
        generator = torch.Generator().manual_seed(spec.seed)
        tensors = {}
        for index, role in enumerate(("prompt", "negative_prompt")):
            for name, width, masks in (
                ("embeds", denoiser.text_dim, TEXT_MASKS),
                ("glyph_embeds", denoiser.glyph_dim, GLYPH_MASKS),
            ):
                mask = torch.tensor([masks[index]])
                embeds = torch.randn(1, mask.shape[1], width, generator=generator)
                tensors[f"{role}_{name}"] = embeds * mask.unsqueeze(-1)
                tensors[f"{role}_{name}_mask"] = mask
        return tensors

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        return denoiser.initial_noise(self.spec)

    def pipeline_latents(self, model_dir: Path, denoiser: Any, experts: dict[str, torch.nn.Module]) -> torch.Tensor:
        return self.pipeline_run(HunyuanVideo15Pipeline.from_pretrained(model_dir, **experts), denoiser, self.spec)

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """HunyuanVideo15Pipeline's latents given the same tensors, its guider at the request's scale."""
        pipeline.set_progress_bar_config(disable=True)
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=spec.guidance_scale)
        tensors = self.conditioning(denoiser, spec)
        texts = {}
        for role, prefix in (("prompt", ""), ("negative_prompt", "negative_")):
            texts[f"{prefix}prompt_embeds"] = tensors[f"{role}_embeds"]
            texts[f"{prefix}prompt_embeds_mask"] = tensors[f"{role}_embeds_mask"]
            texts[f"{prefix}prompt_embeds_2"] = tensors[f"{role}_glyph_embeds"]
            texts[f"{prefix}prompt_embeds_mask_2"] = tensors[f"{role}_glyph_embeds_mask"]
        return pipeline(
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            num_inference_steps=spec.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
            **texts,
        ).frames

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        """The prompt of `compile_text_lengths[index]` (all real) beside the fixed negative prompt."""
        spec = self.compile_specs[index]
        tensors = self.conditioning(denoiser, spec)
        text, glyphs = self.compile_text_lengths[index]
        generator = torch.Generator().manual_seed(100 + index)
        for name, length, width in (("embeds", text, denoiser.text_dim), ("glyph_embeds", glyphs, denoiser.glyph_dim)):
            tensors[f"prompt_{name}"] = torch.randn(1, length, width, generator=generator)
            tensors[f"prompt_{name}_mask"] = torch.ones(1, length, dtype=torch.long)
        return tensors


class HunyuanVideo15I2VTesterConfig(HunyuanVideo15TesterConfig):
    """HunyuanVideo 1.5 image-to-video: the first frame's latents beside the noise with their mask and its SigLIP
    embedding among the text tokens (16 of them, all real), on the text-to-video requests."""

    family = "hunyuanvideo-1.5-i2v"
    spec = dataclasses.replace(HunyuanVideo15TesterConfig.spec, image_roles=("first_frame",))
    parallel_specs = tuple(
        dataclasses.replace(each, image_roles=("first_frame",)) for each in HunyuanVideo15TesterConfig.parallel_specs
    )
    compile_specs = tuple(
        dataclasses.replace(each, image_roles=("first_frame",)) for each in HunyuanVideo15TesterConfig.compile_specs
    )

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """The texts, and the frame's tensors in the shapes the DiT stage accepts for `spec`."""
        tensors = super().conditioning(denoiser, spec)
        generator = torch.Generator().manual_seed(1000 + spec.seed)
        for name in ("image_embeds", "image_latents"):
            shape = [16 if size is None else size for size in denoiser.image_tensor_shape(name, spec)]
            tensors[name] = torch.randn(*shape, generator=generator)
        return tensors
