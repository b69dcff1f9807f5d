"""The FLUX.1 denoising loop, step for step as FluxPipeline runs it.

Latents are packed into 2x2 patches (a [1, h/2 * w/2, 4C] sequence) with their (0, row, column) position ids,
the text's ids are zeros, the scheduler's sigmas are the pipeline's linspace with the shift `mu` computed from
the sequence length (dynamic shifting; FLUX.1-schnell's scheduler config turns it off and the same calls apply
its fixed shift), and the transformer gets `timestep / 1000`. The noise is drawn from the seed exactly as the
pipeline draws it, so the latents equal what the in-process pipeline computes for the same arguments.

Two guidances, as in FluxPipeline:
- `embedded_guidance_scale` is the pipeline's `guidance_scale`: FLUX.1-dev is guidance-distilled and takes it as an
  input of the transformer (one pass per step); FLUX.1-schnell has no guidance embedding and takes none.
- `guidance_scale` is the pipeline's `true_cfg_scale` with the negative prompt: above 1 both branches run (the
  orchestrator then always sends the negative prompt's embeddings) and are combined as
  `negative + scale * (positive - negative)`, without Qwen-Image's rescale.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.flux.family import FLUX
from families.flux.parallel import parallelize
from stagekit.denoise import BatchRows, DenoiseSpec, guidance_predictions, guide_rows, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer


class FluxText:
    """The conditioning of one text (or of a batch's texts, one per row) as the transformer takes it: T5's
    sequence [B, L, dim], CLIP's pooled vector [B, pooled_dim] and the text's position ids (zeros [L, 3], one
    table for every row)."""

    def __init__(self, embeds: torch.Tensor, pooled: torch.Tensor) -> None:
        self.embeds = embeds
        self.pooled = pooled
        self.ids = torch.zeros(embeds.shape[1], 3, device=embeds.device, dtype=embeds.dtype)

    @classmethod
    def from_conditioning(
        cls, conditioning: dict[str, torch.Tensor], role: str, device: torch.device, dtype: torch.dtype
    ) -> FluxText:
        """`role` "prompt" or "negative_prompt": its "<role>_embeds" and "<role>_pooled_embeds"."""
        return cls(
            conditioning[f"{role}_embeds"].to(device, dtype), conditioning[f"{role}_pooled_embeds"].to(device, dtype)
        )

    def rows(self, kept: list[int]) -> FluxText:
        """The texts of the batch rows `kept`."""
        return FluxText(self.embeds[kept], self.pooled[kept])


class FluxDenoiser:
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
            FluxTransformer2DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=FLUX,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        # FluxPipeline: 2 ** (len(block_out_channels) - 1), and 2x2 packing on top.
        self.vae_scale_factor = 2 ** (len(vae_config.get("block_out_channels", [128, 256, 512, 512])) - 1)

    @property
    def experts(self) -> list[FluxTransformer2DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.joint_attention_dim

    @property
    def pooled_dim(self) -> int:
        return self.transformer.config.pooled_projection_dim

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels // 4

    @property
    def guidance_distilled(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    def latent_size(self, spec: DenoiseSpec) -> tuple[int, int]:
        """Latent rows and columns, as FluxPipeline.prepare_latents computes them."""
        return 2 * (spec.height // (self.vae_scale_factor * 2)), 2 * (spec.width // (self.vae_scale_factor * 2))

    def initial_noise(self, spec: DenoiseSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The seed's packed noise [1, h/2 * w/2, 4C], drawn as FluxPipeline draws it with
        generator=torch.Generator('cpu').manual_seed(seed), and the image tokens' position ids [h/2 * w/2, 3]."""
        height, width = self.latent_size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = (1, self.latent_channels, height, width)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        packed = FluxPipeline._pack_latents(latents, 1, self.latent_channels, height, width)
        ids = FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, self.device, dtype)
        return packed, ids

    def timesteps(self, spec: DenoiseSpec, image_tokens: int) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """A fresh scheduler set to the request's steps, with FluxPipeline's sigmas and shift."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = spec.num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            image_tokens,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def _predict(
        self,
        latents: torch.Tensor,
        image_ids: torch.Tensor,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None,
        text: FluxText,
        branch: str,
    ) -> torch.Tensor:
        # A cache context per branch, as FluxPipeline keeps one (diffusers' cache hooks key on it).
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents,
                timestep=timestep / 1000,
                guidance=guidance,
                pooled_projections=text.pooled,
                encoder_hidden_states=text.embeds,
                txt_ids=text.ids,
                img_ids=image_ids,
                joint_attention_kwargs={},
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

        `conditioning`: "prompt_embeds" [1, L, dim] and "prompt_pooled_embeds" [1, pooled_dim]; with
        guidance_scale > 1 also the negative prompt's.
        """
        dtype = self.transformer.dtype
        prompt = FluxText.from_conditioning(conditioning, "prompt", self.device, dtype)
        do_true_cfg = spec.do_classifier_free_guidance
        negative = None
        if do_true_cfg:
            if conditioning.get("negative_prompt_embeds") is None:
                raise ValueError("negative_prompt_embeds are required when guidance_scale (true CFG) > 1")
            negative = FluxText.from_conditioning(conditioning, "negative_prompt", self.device, dtype)

        latents, image_ids = self.initial_noise(spec, dtype)
        scheduler, timesteps = self.timesteps(spec, latents.shape[1])
        guidance = None
        if self.guidance_distilled:
            if spec.embedded_guidance_scale is None:
                raise ValueError("embedded_guidance_scale is required: this transformer is guidance-distilled")
            guidance = torch.full([1], spec.embedded_guidance_scale, device=self.device, dtype=torch.float32)

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            predict = partial(self._predict, latents, image_ids, timestep, guidance)
            if not do_true_cfg:
                noise_pred = predict(prompt, "cond")
            else:
                noise_pred, neg_noise_pred = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = neg_noise_pred + spec.guidance_scale * (noise_pred - neg_noise_pred)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        return FluxPipeline._unpack_latents(latents, spec.height, spec.width, self.vae_scale_factor).unsqueeze(2)


class FluxBatchDenoiser(FluxDenoiser):
    """FluxDenoiser that also denoises a batch of requests (`--max-batch-size`): the flux family's DiT. FLUX.1
    Kontext's denoiser extends FluxDenoiser without it: its requests carry their own reference images."""

    @torch.no_grad()
    def denoise_batch(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[torch.Tensor | None]:
        """`denoise` for several requests of one batch_key (dit_svc/denoise.py: one size, step count and guidance
        branches; T5's sequences of one length) at once: one transformer pass per step and branch serves every
        request. Each row is its request's own run: its seed's noise, its texts, its true-CFG scale and its
        embedded guidance (the transformer embeds one guidance value per row). A member no longer wanted leaves
        the batch before the next step."""
        first = specs[0]
        dtype = self.transformer.dtype
        texts = [FluxText.from_conditioning(c, "prompt", self.device, dtype) for c in conditionings]
        prompt = FluxText(torch.cat([t.embeds for t in texts]), torch.cat([t.pooled for t in texts]))
        negative = None
        if first.do_classifier_free_guidance:
            texts = [FluxText.from_conditioning(c, "negative_prompt", self.device, dtype) for c in conditionings]
            negative = FluxText(torch.cat([t.embeds for t in texts]), torch.cat([t.pooled for t in texts]))
        scales = [spec.guidance_scale for spec in specs]
        noise = [self.initial_noise(spec, dtype) for spec in specs]
        latents, image_ids = torch.cat([packed for packed, _ in noise]), noise[0][1]
        scheduler, timesteps = self.timesteps(first, latents.shape[1])
        guidance = None
        if self.guidance_distilled:
            if any(spec.embedded_guidance_scale is None for spec in specs):
                raise ValueError("embedded_guidance_scale is required: this transformer is guidance-distilled")
            embedded = [float(spec.embedded_guidance_scale or 0.0) for spec in specs]
            guidance = torch.tensor(embedded, device=self.device, dtype=torch.float32)
        rows = BatchRows(len(specs))

        for i, t in enumerate(timesteps):
            kept = rows.before_step(wanted, self.parallel, self.device, scheduler)
            if kept is not None:
                latents, prompt, scales = latents[kept], prompt.rows(kept), [scales[row] for row in kept]
                negative = negative.rows(kept) if negative is not None else None
                guidance = guidance[kept] if guidance is not None else None
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            predict = partial(self._predict, latents, image_ids, timestep, guidance)
            if negative is None:
                noise_pred = predict(prompt, "cond")
            else:
                noise_cond, noise_uncond = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = guide_rows(noise_cond, noise_uncond, scales)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            rows.stepped(on_step, i + 1, len(timesteps))
        return [
            None
            if row is None
            else FluxPipeline._unpack_latents(row, first.height, first.width, self.vae_scale_factor).unsqueeze(2)
            for row in rows.results(latents)
        ]
