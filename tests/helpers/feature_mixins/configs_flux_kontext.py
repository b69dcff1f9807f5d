"""The FLUX.1 Kontext tester config, beside configs.py (which holds the others): FLUX.1's with the reference
image's packed latents after the noise tokens.

It is what proves that FLUX.1's sequence-parallel plan, which splits `hidden_states` and `img_ids` at the
transformer's input, applies to Kontext's joint sequence unchanged: every layout's latents equal one rank's,
and each rank's first attention takes its share of the noise and image tokens together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import PIL.Image
import torch
from diffusers import FluxKontextPipeline

from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from tests.helpers.feature_mixins.configs import CFG2, HSDP2X2_ULYSSES2_CFG2, RING2, TP2, ULYSSES2
from tests.helpers.feature_mixins.configs_flux import FluxTesterConfig


class FluxKontextTesterConfig(FluxTesterConfig):
    """FLUX.1 Kontext (the tiny 32x VAE): two steps with the embedded guidance and true CFG, one reference image.
    The requests' sequences: 234 image tokens (a 300x200 image, resized to 1152x832) after 2 noise tokens
    (64x128), then 240 (a 90x150 image, resized to 640x1536) after 6 (192x128), which 4 does not divide."""

    family = "flux-kontext"
    pipeline_class = FluxKontextPipeline
    model_fixture = "flux_kontext_model"
    pipeline_fixture = "flux_kontext_pipeline"
    spec = DenoiseSpec(64, 128, 1, 2, 3.0, 1, ("reference",), ((300, 200),), embedded_guidance_scale=3.5)
    parallel_specs = (
        spec,
        DenoiseSpec(192, 128, 1, 2, 3.0, 0, ("reference",), ((90, 150),), embedded_guidance_scale=2.5),
    )
    # FLUX.1's batching is not built with the reference image (families/flux_kontext/family.py).
    batch_layouts: ClassVar[list[tuple[str, ParallelConfig]]] = []
    lora_spec = spec
    # FLUX.1's step caches over the noise and reference tokens together (the first block's residual of both).
    step_cache_spec = dataclasses.replace(spec, num_inference_steps=8)
    step_cache_layouts: ClassVar[dict[int, list[tuple[str, ParallelConfig]]]] = {2: [ULYSSES2, CFG2]}
    # Noise and reference tokens 2 + 234, then 6 + 240 with a longer text, then 12 + 216 with a shorter one; the
    # embedded guidance alone (one pass a step).
    compile_specs = (
        dataclasses.replace(spec, guidance_scale=1.0),
        DenoiseSpec(192, 128, 1, 2, 1.0, 2, ("reference",), ((90, 150),), embedded_guidance_scale=2.5),
        DenoiseSpec(128, 192, 1, 2, 1.0, 3, ("reference",), ((200, 180),), embedded_guidance_scale=3.5),
    )
    # The image-families cluster runs Ulysses over two ranks (tests/e2e/test_image_families_cluster.py).
    parallel_layouts = {2: [ULYSSES2, RING2, CFG2, TP2], 4: [HSDP2X2_ULYSSES2_CFG2]}

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """FLUX.1's texts, and the reference image's latents as the VAE's Encode sends them."""
        conditioning = super().conditioning(denoiser, spec)
        generator = torch.Generator().manual_seed(100 + spec.seed)
        shape = denoiser.image_tensor_shape("image_latents", spec)
        conditioning["image_latents"] = torch.randn(shape, generator=generator)
        return conditioning

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """FluxKontextPipeline's final latents of `spec` (`max_area` the request's, so that its output is the
        request's size), given a blank reference image of the request's size whose encoded latents are replaced
        by the config's (those the VAE stage would send), taken at its last step and unpacked."""
        conditioning = self.conditioning(denoiser, spec)
        prepare = pipeline.prepare_latents

        def with_our_reference(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
            latents, image_latents, latent_ids, image_ids = prepare(*args, **kwargs)
            ours = conditioning["image_latents"]
            assert image_latents.shape == ours.shape, (tuple(image_latents.shape), tuple(ours.shape))
            return latents, ours.to(image_latents), latent_ids, image_ids

        final: dict[str, torch.Tensor] = {}

        def keep(pipe: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            final["latents"] = tensors["latents"]
            return tensors

        pipeline.prepare_latents = with_our_reference
        pipeline.set_progress_bar_config(disable=True)
        try:
            pipeline(
                image=PIL.Image.new("RGB", spec.image_sizes[0]),
                prompt_embeds=conditioning["prompt_embeds"],
                pooled_prompt_embeds=conditioning["prompt_pooled_embeds"],
                negative_prompt_embeds=conditioning["negative_prompt_embeds"],
                negative_pooled_prompt_embeds=conditioning["negative_prompt_pooled_embeds"],
                height=spec.height,
                width=spec.width,
                max_area=spec.height * spec.width,
                num_inference_steps=spec.num_inference_steps,
                guidance_scale=spec.embedded_guidance_scale,
                true_cfg_scale=spec.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(spec.seed),
                callback_on_step_end=keep,
                output_type="latent",
            )
        finally:
            del pipeline.prepare_latents
        unpacked = FluxKontextPipeline._unpack_latents(
            final["latents"], spec.height, spec.width, pipeline.vae_scale_factor
        )
        return unpacked.unsqueeze(2)

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        """FLUX.1's text of that length, and the request's reference latents."""
        conditioning = super().compile_conditioning(denoiser, index)
        spec = self.compile_specs[index]
        generator = torch.Generator().manual_seed(100 + spec.seed)
        shape = denoiser.image_tensor_shape("image_latents", spec)
        conditioning["image_latents"] = torch.randn(shape, generator=generator)
        return conditioning

    def parallel_outputs(self, denoiser: Any) -> dict[str, Any]:
        """Also the image tokens (noise and reference) each forward's first attention took on the rank."""
        tokens: list[int] = []
        handle = denoiser.transformer.transformer_blocks[0].attn.register_forward_pre_hook(
            lambda module, args, kwargs: tokens.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
        )
        outputs = super().parallel_outputs(denoiser)
        handle.remove()
        outputs["tokens"] = tokens
        return outputs

    def check_parallel_outputs(
        self, name: str, layout: ParallelConfig, per_rank: list[dict[str, Any]], one_rank: dict[str, Any]
    ) -> None:
        split = layout.ulysses_degree * layout.ring_degree
        for rank, outputs in enumerate(per_rank):
            assert len(outputs["tokens"]) == len(one_rank["tokens"]) // layout.cfg_degree, (name, rank)
            # Per request, one rank's token count is the whole joint sequence; each rank here takes its share.
            wholes = sorted(set(one_rank["tokens"]))
            shares = sorted({-(-whole // split) for whole in wholes})
            assert sorted(set(outputs["tokens"])) == shares, (name, rank, outputs["tokens"], wholes)
