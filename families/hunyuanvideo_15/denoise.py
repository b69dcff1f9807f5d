"""The HunyuanVideo 1.5 denoising loop, step for step as HunyuanVideo15Pipeline (text-to-video) and
HunyuanVideo15ImageToVideoPipeline run it.

The latents [1, 32, T, h, w] (T = (frames - 1) / 4 + 1, h and w a 16th of the size) are drawn from the seed in the
transformer's dtype, as the pipeline draws them. Each step the transformer takes them concatenated with the
condition latents and their mask along the channels (65 channels: zeros for text-to-video), the raw timestep,
both texts (Qwen2.5-VL's sequence and ByT5's glyphs, each with its mask) and the image embedding (a zero image
for text-to-video, which the transformer masks out). The sigmas are the pipeline's linspace(1, 0) without its
last point, shifted by the scheduler's own shift. Image-to-video differs only in the condition: the first frame's
latents (the VAE stage's Encode) in latent frame 0 with its mask, and SigLIP's embedding of the frame (the text
encoder stage's); a mean-flow transformer (`use_meanflow`, the step-distilled checkpoints) also gets the next
timestep there.

Guidance is the checkpoint's guider component (`guider/`, a diffusers ClassifierFreeGuidance), built per request
with the request's guidance_scale: it says at each step whether both branches run (its scale, start and stop) and
combines them (`uncond + scale * (cond - uncond)`, its rescale). The pipeline runs the branches one after the
other; here they run the same way, or one per CFG rank group under CFG-parallel.

Each text arrives at its own length with a mask (families/hunyuanvideo_15/encode.py); the pipeline pads to 1000
and 256 tokens and gives a 729-token zero image embedding for text-to-video. The transformer moves every masked
position after the real ones and attends to none of them, so the result depends on the real positions only; the
shorter sequences here give the pipeline's latents within float rounding at a fraction of the attention's cost.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.hunyuanvideo_15.family import HUNYUANVIDEO_15
from families.hunyuanvideo_15.parallel import parallelize
from stagekit.denoise import DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer

# The guider class this loop runs (the published checkpoints' `guider` component).
GUIDER_CLASS = "ClassifierFreeGuidance"


def _trimmed(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops the trailing positions no text of the request needed (the stage pads to its longest text); keeps
    one masked row when nothing is real (a prompt without glyphs)."""
    real = mask[0].nonzero()
    length = int(real.max()) + 1 if real.numel() else 1
    return embeds[:, :length], mask[:, :length]


@dataclass(frozen=True)
class HunyuanText:
    """One text's conditioning: Qwen2.5-VL's embeddings [1, L, 3584] and ByT5's [1, G, 1472], each with its mask."""

    embeds: torch.Tensor
    mask: torch.Tensor
    glyph_embeds: torch.Tensor
    glyph_mask: torch.Tensor

    @classmethod
    def from_conditioning(
        cls, conditioning: dict[str, torch.Tensor], role: str, device: torch.device, dtype: torch.dtype
    ) -> HunyuanText:
        """The text `role` ("prompt" or "negative_prompt") as the DiT stage received it, on `device`."""

        def part(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            embeds = conditioning[name]
            mask = conditioning.get(f"{name}_mask")
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long)
            embeds, mask = _trimmed(embeds, mask)
            # The pipeline hands the transformer its masks in the transformer's dtype; the model makes them bool.
            return embeds.to(device, dtype), mask.to(device, dtype)

        embeds, mask = part(f"{role}_embeds")
        glyph_embeds, glyph_mask = part(f"{role}_glyph_embeds")
        return cls(embeds, mask, glyph_embeds, glyph_mask)


class HunyuanVideo15Denoiser:
    """The denoising loop on one rank; with a parallel layout, every rank of the group runs it in step."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        parallel: ParallelConfig | None = None,
        options: TransformerOptions | None = None,
        load_threads: int = 4,
    ) -> None:
        model_dir = Path(model_dir)
        self.device = device
        loaded = load_parallel_transformer(
            HunyuanVideo15Transformer3DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=HUNYUANVIDEO_15,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        guider_class = json.loads((model_dir / "model_index.json").read_text()).get("guider", [None, GUIDER_CLASS])[1]
        if guider_class != GUIDER_CLASS:
            raise ValueError(f"{model_dir}: guider {guider_class} is not served; this family runs {GUIDER_CLASS}")
        guider_dir = model_dir / "guider"
        self.guider_config = ClassifierFreeGuidance.load_config(guider_dir) if guider_dir.is_dir() else {}
        # Built once (diffusers warns that guiders are experimental each time one is made); each request copies it.
        self._guider = ClassifierFreeGuidance.from_config(self.guider_config)
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        self.vae_scale_spatial = vae_config.get("spatial_compression_ratio", 16)
        self.vae_scale_temporal = vae_config.get("temporal_compression_ratio", 4)
        self.latent_channels = vae_config.get("latent_channels", 32)

    @property
    def experts(self) -> list[HunyuanVideo15Transformer3DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.text_embed_dim

    @property
    def glyph_dim(self) -> int:
        """The width of ByT5's embeddings the transformer takes."""
        return self.transformer.config.text_embed_2_dim

    def latent_shape(self, spec: DenoiseSpec) -> tuple[int, int, int, int, int]:
        """As HunyuanVideo15Pipeline.prepare_latents computes it."""
        return (
            1,
            self.latent_channels,
            (spec.num_frames - 1) // self.vae_scale_temporal + 1,
            spec.height // self.vae_scale_spatial,
            spec.width // self.vae_scale_spatial,
        )

    def initial_noise(self, spec: DenoiseSpec) -> torch.Tensor:
        """The seed's noise, drawn as the pipeline draws it with generator=torch.Generator('cpu').manual_seed(seed),
        in the transformer's dtype."""
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        return randn_tensor(
            self.latent_shape(spec), generator=generator, device=self.device, dtype=self.transformer.dtype
        )

    def guider(self, spec: DenoiseSpec) -> ClassifierFreeGuidance:
        """The checkpoint's guider with the request's scale: a copy of its own, whose per-step state is the
        request's."""
        guider = copy.copy(self._guider)
        guider.guidance_scale = spec.guidance_scale
        return guider

    def _predict(
        self,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        timestep_r: torch.Tensor | None,
        image_embeds: torch.Tensor,
        text: HunyuanText,
        branch: str,
    ) -> torch.Tensor:
        # The guider's branch names, as the pipeline's cache contexts (diffusers' cache hooks key on them).
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=model_input,
                image_embeds=image_embeds,
                timestep=timestep,
                timestep_r=timestep_r,
                encoder_hidden_states=text.embeds,
                encoder_attention_mask=text.mask,
                encoder_hidden_states_2=text.glyph_embeds,
                encoder_attention_mask_2=text.glyph_mask,
                attention_kwargs=None,
                return_dict=False,
            )[0]

    def condition(self, latents: torch.Tensor, conditioning: dict[str, torch.Tensor]) -> tuple:
        """(condition latents and their mask concatenated [1, C + 1, T, h, w], image embeddings [1, N, dim]).

        Image-to-video (`image_latents` [1, C, 1, h, w] from the VAE's Encode, `image_embeds` from SigLIP): the
        first frame's latents in latent frame 0, zeros after, the mask 1 on frame 0 (the pipeline's
        `prepare_cond_latents_and_mask`). Text-to-video: zeros, and a single zero image token standing for the
        pipeline's 729 (the transformer masks a zero image embedding whatever its length).
        """
        dtype = latents.dtype
        batch, channels, frames, height, width = latents.shape
        cond = torch.zeros(batch, channels + 1, frames, height, width, dtype=dtype, device=self.device)
        image_latents = conditioning.get("image_latents")
        if image_latents is None:
            image_embeds = torch.zeros(batch, 1, self.image_dim, dtype=dtype, device=self.device)
            return cond, image_embeds
        cond[:, :channels, :1] = image_latents.to(self.device, dtype)
        cond[:, channels, 0] = 1.0
        return cond, conditioning["image_embeds"].to(self.device, dtype)

    @property
    def image_dim(self) -> int:
        """The width of the image embedding the transformer takes (SigLIP's)."""
        return self.transformer.config.image_embed_dim

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The first frame's SigLIP embedding [1, N, image_dim] and latents [1, C, 1, h, w]."""
        if spec.image_roles != ("first_frame",):
            return None
        if name == "image_embeds":
            return (1, None, self.image_dim)
        if name == "image_latents":
            _, channels, _, height, width = self.latent_shape(spec)
            return (1, channels, 1, height, width)
        return None

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns float32 latents [1, 32, T, h, w]; on_step(step, total) after each.

        `conditioning`: "prompt_embeds", "prompt_glyph_embeds" (each with an optional "_mask") and, when the
        guider runs both branches, the same for "negative_prompt".
        """
        dtype = self.transformer.dtype
        prompt = HunyuanText.from_conditioning(conditioning, "prompt", self.device, dtype)
        negative = None
        if "negative_prompt_embeds" in conditioning:
            negative = HunyuanText.from_conditioning(conditioning, "negative_prompt", self.device, dtype)

        latents = self.initial_noise(spec)
        cond, image_embeds = self.condition(latents, conditioning)
        guider = self.guider(spec)
        steps = spec.num_inference_steps
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas)

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            model_input = torch.cat([latents, cond], dim=1)
            timestep = t.expand(model_input.shape[0]).to(model_input.dtype)
            guider.set_state(step=i, num_inference_steps=steps, timestep=t)
            timestep_r = None
            if self.transformer.config.use_meanflow and "image_latents" in conditioning:
                # A mean-flow (step-distilled) transformer also takes the next timestep, 0 after the last, as the
                # image-to-video pipeline gives it (the text-to-video pipeline gives none).
                following = timesteps[i + 1] if i + 1 < len(timesteps) else torch.tensor(0.0, device=self.device)
                timestep_r = following.expand(latents.shape[0]).to(latents.dtype)
            predict = partial(self._predict, model_input, timestep, timestep_r, image_embeds)
            if guider.num_conditions > 1:
                if negative is None:
                    scale = spec.guidance_scale
                    raise ValueError(
                        f"negative_prompt_embeds are required: the guider runs CFG at guidance_scale {scale:g}"
                    )
                pred_cond, pred_uncond = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = guider.forward(pred_cond, pred_uncond).pred
            else:
                noise_pred = guider.forward(predict(prompt, "cond")).pred
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        return latents.float()
