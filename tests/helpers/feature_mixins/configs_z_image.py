"""Z-Image's tester config (tests/helpers/feature_mixins/base.py says what a config declares)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    ZImagePipeline,
    ZImageTransformer2DModel,
)

from stagekit.denoise import DenoiseSpec
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
from tests.helpers.lora_adapters import Z_IMAGE_TARGETS

# By seed, the (prompt, negative prompt) masks as the text encoder sends them: both texts padded to the longer one,
# each text then of its own length in the transformer.
Z_IMAGE_MASKS = {
    0: ([1] * 7 + [0, 0], [1] * 9),
    1: ([1] * 5, [1] * 3 + [0, 0]),
    # The batch's other members (BatchingTesterMixin's seeds 1 to 3). The transformer pads each caption to a
    # multiple of 32 tokens with its pad token, which is attended; a batch masks what lies beyond a shorter
    # sequence, so these texts reach past 32 tokens, to different lengths.
    2: ([1] * 40, [1] * 33 + [0] * 7),
    3: ([1] * 70, [1] * 4 + [0] * 66),
}


class ZImageTesterConfig(FamilyTesterConfig):
    """Z-Image: two steps with CFG, texts of their own lengths. ZImageTransformer2DModel pads the image and the
    caption to multiples of 32 tokens itself, so the layouts split 64 joint tokens whatever the size; the two
    requests differ in size, guidance and text lengths."""

    family = "z-image"
    pipeline_class = ZImagePipeline
    model_fixture = "z_image_model"
    pipeline_fixture = "z_image_pipeline"
    # 48x80 -> 3 x 5 patches of 2x2 latents.
    spec = DenoiseSpec(
        height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0, cfg_threshold=0.0
    )
    parallel_specs = (
        spec,
        DenoiseSpec(
            height=64, width=96, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=1, cfg_threshold=0.0
        ),
    )
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = ZImageTransformer2DModel
    blocks_attribute = "layers"
    more_block_lists = ("noise_refiner", "context_refiner")
    ignored_layers = ("all_final_layer.*", "layers.0.*", "t_embedder.*")
    ignored_prefixes = ("all_final_layer.", "layers.0.", "t_embedder.")
    min_reference_std = 0.1
    parallel_layouts = {2: [ULYSSES2, RING2, CFG2, TP2, HSDP2], 4: [USP2X2, TP2_RING2, HSDP2X2_ULYSSES2_CFG2]}
    # TP leaves the timestep embedder whole: its fixed 256-1024-256 MLP is 56% of this tiny model's parameters
    # (0.1% of Z-Image's 6B), so a TP rank holds 83% of them here.
    max_sharded_fraction = 0.9
    # ZImagePipeline's CFG, positive + 4 (positive - negative), weighs the positive prediction five times where
    # the other families' weigh it four (negative + 4 (positive - negative)): FP8 of every linear moves this tiny
    # model's update by 6.3% (FLUX.1: 4.7%, Qwen-Image: 4.4%), and no layer kept in bf16 brings it under 5%.
    quantized_limit = 0.07
    # Image tokens 15 (padded to 32), then 24 with a caption past 32 tokens (64 with its padding), then 8 with a
    # short one; each with CFG, so both branches' captions (of their own lengths) run the same blocks.
    compile_specs = (
        DenoiseSpec(48, 80, 1, 2, 4.0, 1, cfg_threshold=0.0),
        DenoiseSpec(64, 96, 1, 2, 3.0, 2, cfg_threshold=0.0),
        DenoiseSpec(32, 64, 1, 2, 5.0, 3, cfg_threshold=0.0),
    )
    lora_spec = spec
    lora_targets = tuple(Z_IMAGE_TARGETS)
    lora_layouts = SEQUENCE_AND_CFG_2
    # The batch's texts differ in length: under Ulysses and Ring the model's mask of the shorter ones is split too.
    batch_layouts = [ULYSSES2, RING2, CFG2, TP2]

    def is_ignored(self, name: str) -> bool:
        return name.startswith(self.ignored_prefixes)

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Both texts with their masks, as the DiT stage receives them."""
        generator = torch.Generator().manual_seed(spec.seed)
        prompt_mask, negative_mask = Z_IMAGE_MASKS[spec.seed]
        return {
            "prompt_embeds": torch.randn(1, len(prompt_mask), denoiser.text_dim, generator=generator),
            "prompt_embeds_mask": torch.tensor([prompt_mask]),
            "negative_prompt_embeds": torch.randn(1, len(negative_mask), denoiser.text_dim, generator=generator),
            "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        return denoiser.initial_noise(self.spec).unsqueeze(2)

    def offloaded_block_lists(self, expert: torch.nn.Module) -> list[list[torch.nn.Module]]:
        """Both refiners, the caption embedder (a Sequential) and the main layers: each its own groups."""
        return [
            list(expert.noise_refiner),
            list(expert.context_refiner),
            list(expert.cap_embedder),
            list(expert.layers),
        ]

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """ZImagePipeline's latents, each text's own rows given as its prompt embeddings, as [1, C, 1, h, w]."""
        from families.z_image.denoise import text_from_wire

        conditioning = self.conditioning(denoiser, spec)
        texts = {
            name: [text_from_wire(conditioning[name], conditioning[f"{name}_mask"])]
            for name in ("prompt_embeds", "negative_prompt_embeds")
        }
        pipeline.set_progress_bar_config(disable=True)
        latents = pipeline(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
            **texts,
        ).images
        return latents.unsqueeze(2)

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        """The texts of `compile_specs[index]` as the batch members' (Z_IMAGE_MASKS by seed)."""
        return self.conditioning(denoiser, self.compile_specs[index])
