"""The Qwen-Image denoising loop, step for step as QwenImagePipeline runs it.

Latents are packed into 2x2 patches (a [1, h/2 * w/2, 4C] sequence), the scheduler's sigmas are the
pipeline's linspace with the shift `mu` computed from that sequence length (dynamic shifting), the
transformer gets `timestep / 1000`, the image shapes and the text mask, and true CFG combines the two
branches with the pipeline's norm-preserving rescale. The noise is drawn from the seed exactly as the
pipeline draws it, so the latents equal what the in-process pipeline computes for the same arguments.

The request's `guidance_scale` is the pipeline's `true_cfg_scale`: above 1 (with the negative prompt's
embeddings, which the orchestrator always sends then) both branches run; Qwen-Image is not
guidance-distilled, so the pipeline's own `guidance_scale` input plays no part.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.qwen_image.family import QWEN_IMAGE
from families.qwen_image.parallel import parallelize
from stagekit.denoise import DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer


@dataclass(frozen=True)
class QwenTextEmbeds:
    """One text's conditioning: embeddings [1, L, dim] and their mask [1, L], None when every position is real."""

    embeds: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def from_wire(cls, embeds: torch.Tensor, mask: torch.Tensor | None) -> QwenTextEmbeds:
        """Drops trailing padding and, as QwenImagePipeline.encode_prompt does, a mask that is all ones.

        The text encoder pads each text to the longest one of its request; the pipeline encodes each
        text alone, unpadded, so the transformer must see the unpadded sequence to match it.
        """
        if mask is None:
            return cls(embeds, None)
        mask = mask.to(torch.long)
        positions = mask[0].nonzero()
        if positions.numel() == 0:
            raise ValueError("the embeddings' mask marks no token")
        length = int(positions.max()) + 1
        embeds, mask = embeds[:, :length], mask[:, :length]
        return cls(embeds, None if bool(mask.all()) else mask)

    @classmethod
    def from_conditioning(cls, conditioning: dict[str, torch.Tensor], name: str) -> QwenTextEmbeds:
        """One text's embeddings and mask as the DiT stage received them ("<name>", optional "<name>_mask")."""
        return cls.from_wire(conditioning[name], conditioning.get(f"{name}_mask"))

    def to(self, device: torch.device, dtype: torch.dtype) -> QwenTextEmbeds:
        mask = self.mask.to(device) if self.mask is not None else None
        return QwenTextEmbeds(self.embeds.to(device, dtype), mask)


class QwenImageDenoiser:
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
            QwenImageTransformer2DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=QWEN_IMAGE,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        # QwenImagePipeline: 2 ** len(temperal_downsample), and 2x2 packing on top.
        self.vae_scale_factor = 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))

    @property
    def experts(self) -> list[QwenImageTransformer2DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.joint_attention_dim

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels // 4

    def latent_size(self, spec: DenoiseSpec) -> tuple[int, int]:
        """Latent rows and columns, as QwenImagePipeline.prepare_latents computes them."""
        return 2 * (spec.height // (self.vae_scale_factor * 2)), 2 * (spec.width // (self.vae_scale_factor * 2))

    def initial_noise(self, spec: DenoiseSpec, dtype: torch.dtype) -> torch.Tensor:
        """The seed's packed noise [1, h/2 * w/2, 4C], drawn as QwenImagePipeline draws it with
        generator=torch.Generator('cpu').manual_seed(seed)."""
        height, width = self.latent_size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = (1, 1, self.latent_channels, height, width)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        return QwenImagePipeline._pack_latents(latents, 1, self.latent_channels, height, width)

    def _predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, img_shapes: list, text: QwenTextEmbeds, branch: str
    ) -> torch.Tensor:
        # A cache context per branch, as QwenImagePipeline keeps one (diffusers' cache hooks key on it).
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents,
                timestep=timestep / 1000,
                guidance=None,
                encoder_hidden_states_mask=text.mask,
                encoder_hidden_states=text.embeds,
                img_shapes=img_shapes,
                attention_kwargs={},
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
        """Runs every step and returns the latents unpacked to [1, C, 1, h, w]; on_step(step, total) after each.

        `conditioning`: "prompt_embeds" [1, L, dim] with, optionally, "prompt_embeds_mask" [1, L]; with
        guidance_scale > 1 also "negative_prompt_embeds" (and its mask).
        """
        dtype = self.transformer.dtype
        prompt = QwenTextEmbeds.from_conditioning(conditioning, "prompt_embeds").to(self.device, dtype)
        do_true_cfg = spec.do_classifier_free_guidance
        negative = None
        if do_true_cfg:
            if conditioning.get("negative_prompt_embeds") is None:
                raise ValueError("negative_prompt_embeds are required when guidance_scale (true_cfg_scale) > 1")
            negative = QwenTextEmbeds.from_conditioning(conditioning, "negative_prompt_embeds").to(self.device, dtype)

        latents = self.initial_noise(spec, dtype)
        img_shapes = [[(1, spec.height // self.vae_scale_factor // 2, spec.width // self.vae_scale_factor // 2)]]

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = spec.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            predict = partial(self._predict, latents, timestep, img_shapes)
            if not do_true_cfg:
                noise_pred = predict(prompt, "cond")
            else:
                noise_pred, neg_noise_pred = guidance_predictions(predict, prompt, negative, self.cfg_group)
                comb_pred = neg_noise_pred + spec.guidance_scale * (noise_pred - neg_noise_pred)
                cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                noise_pred = comb_pred * (cond_norm / noise_norm)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        return QwenImagePipeline._unpack_latents(latents, spec.height, spec.width, self.vae_scale_factor)
