"""The Wan image-to-video denoising loop, step for step as WanImageToVideoPipeline runs it.

What the pipeline adds to WanPipeline's loop (families/wan/denoise.py), and how it arrives here:
- "image_latents", the VAE-encoded input frames (families/wan_i2v/vae_encode.py, on the VAE stage).
  Wan2.1 and Wan2.2 A14B concatenate them to the noisy latents on every step, after a 4-channel mask of
  the frames that were given (the first, and the last when sent), which is built here from the request's
  image roles. Wan2.2 TI2V (`expand_timesteps`) writes them over the first latent frame instead, and
  gives that frame's tokens timestep 0, on every step and once more after the last.
- "image_embeds", CLIP's embedding of the frames (Wan2.1 only; the text encoder makes it), passed to the
  transformer's image cross-attention in both guidance branches.
Without input images (TI2V's text-to-video) the loop is WanPipeline's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch

from families.wan.denoise import WanDenoiser
from stagekit.denoise import DenoiseSpec, stop_if_cancelled


class WanImageToVideoDenoiser(WanDenoiser):
    """One, or two expert, Wan transformers conditioned on input frames."""

    # Its loop (below) conditions every step on the input frames, and is not written as steps: its requests are
    # not yielded, resumed or batched at the step.
    runs_steps: ClassVar[bool] = False

    @property
    def image_dim(self) -> int | None:
        return self.transformer.config.image_dim

    def latent_shape(self, spec: DenoiseSpec) -> tuple[int, int, int, int, int]:
        # The pipeline draws noise with the VAE's channels; the transformer takes more (mask and image latents).
        _, _, frames, height, width = super().latent_shape(spec)
        return (1, self.transformer.config.out_channels, frames, height, width)

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        _, channels, frames, height, width = self.latent_shape(spec)
        if name == "image_latents":
            return (1, channels, 1 if self.expand_timesteps else frames, height, width)
        if name == "image_embeds" and self.image_dim is not None:
            # One CLIP embedding per image; its token count is the text encoder's CLIP's (None: any).
            return (len(spec.image_roles), None, self.image_dim)
        return None

    def _frame_mask(self, spec: DenoiseSpec, latents: torch.Tensor) -> torch.Tensor:
        """prepare_latents' `mask_lat_size`: [1, 4, T, h, w], ones on the latent frames the given images fill."""
        _, _, _, height, width = latents.shape
        frames = spec.num_frames
        mask = torch.ones(1, 1, frames, height, width)
        last = frames - 1 if "last_frame" in spec.image_roles else frames
        mask[:, :, list(range(1, last))] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=self.vae_scale_temporal)
        mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
        mask = mask.view(1, -1, self.vae_scale_temporal, height, width).transpose(1, 2)
        return mask.to(latents.device)

    @staticmethod
    def _predict_with_image(
        model: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        image_embeds: torch.Tensor | None,
        embeds: torch.Tensor,
        branch: str,
    ) -> torch.Tensor:
        with model.cache_context(branch):
            return model(
                hidden_states=latents,
                timestep=timestep,
                encoder_hidden_states=embeds,
                encoder_hidden_states_image=image_embeds,
                return_dict=False,
            )[0]

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns float32 latents [1, C, T, h, w]; on_step(step, total) after each.

        `conditioning`: the prompts' embeddings as for WanDenoiser, "image_latents" when the request has
        input images, and "image_embeds" for a transformer with image cross-attention (Wan2.1).
        """
        if "image_latents" not in conditioning:
            return super().denoise(spec, conditioning, on_step, cancelled)
        transformer_dtype = self.transformer.dtype
        prompt_embeds = conditioning["prompt_embeds"].to(self.device, transformer_dtype)
        negative_prompt_embeds = None
        if spec.do_classifier_free_guidance:
            negative_prompt_embeds = conditioning["negative_prompt_embeds"].to(self.device, transformer_dtype)
        image_embeds = None
        if self.image_dim is not None:
            image_embeds = conditioning["image_embeds"].to(self.device, transformer_dtype)

        scheduler = self.scheduler_class.from_config(self.scheduler_config)
        scheduler.set_timesteps(spec.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        latents = self.initial_noise(spec)
        image_latents = conditioning["image_latents"].to(self.device, torch.float32)
        if self.expand_timesteps:
            # TI2V: the first latent frame is the image's, at timestep 0.
            first_frame_mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=self.device)
            first_frame_mask[:, :, 0] = 0
        else:
            condition = torch.concat([self._frame_mask(spec, latents), image_latents], dim=1)
        boundary_timestep = None
        if self.boundary_ratio is not None:
            boundary_timestep = self.boundary_ratio * scheduler.config.num_train_timesteps

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            if self.expand_timesteps:
                latent_model_input = ((1 - first_frame_mask) * image_latents + first_frame_mask * latents).to(
                    transformer_dtype
                )
                timestep = (first_frame_mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(1, -1)
            else:
                latent_model_input = torch.cat([latents, condition], dim=1).to(transformer_dtype)
                timestep = t.expand(latents.shape[0])
            # guidance_scale_2 of the pipeline is not exposed: both experts use the request's guidance scale.
            model = self.expert_for(t, boundary_timestep)
            predict = partial(self._predict_with_image, model, latent_model_input, timestep, image_embeds)
            noise_pred = self.guided_prediction(predict, spec, prompt_embeds, negative_prompt_embeds)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        if self.expand_timesteps:
            latents = (1 - first_frame_mask) * image_latents + first_frame_mask * latents
        return latents
