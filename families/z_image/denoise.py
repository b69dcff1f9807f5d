"""The Z-Image denoising loop, step for step as ZImagePipeline runs it.

The latents are [1, C, h, w] in float32 throughout, drawn from the seed as the pipeline draws them; the
transformer takes them as a list of one [C, 1, h, w] image and the text as a list of one [L, dim] embedding
(its mask's positions only: the pipeline's embeddings have each text's own length). The sigmas are the
pipeline's linspace(1, 1/steps), the shift `mu` is computed from the image's 2x2 patch count (used only when the
scheduler shifts dynamically; the published schedulers apply their fixed shift), the transformer gets
`(1000 - t) / 1000` and its prediction is negated before the scheduler's step.

Guidance, as ZImagePipeline's `guidance_scale`: `positive + scale * (positive - negative)`, in float32, with the
pipeline's `cfg_truncation` (steps whose normalised time `(1000 - t) / 1000` exceeds it run the positive branch
alone) and `cfg_normalization` (the guided prediction's norm capped at that many times the positive one's), both
at the pipeline's defaults (1.0: no step is truncated; off). The pipeline runs both branches as one batch of
two; here each branch runs alone (one per CFG rank group under CFG-parallel), which equals the batch within
float32 rounding. The pipeline guides any scale above 0, and so does the family (its `cfg_threshold` is 0: the
orchestrator sends the negative prompt for any scale above 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import (
    calculate_shift,
    get_default_z_image_sigmas,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from families.z_image.family import Z_IMAGE
from families.z_image.parallel import parallelize
from stagekit.denoise import BatchRows, DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer

# ZImagePipeline.__call__'s defaults, which no request changes.
CFG_TRUNCATION = 1.0
CFG_NORMALIZATION = 0.0


def text_from_wire(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One text's [L, dim] embedding as the pipeline hands it to the transformer: the rows its mask marks.

    The text encoder pads each text to the longest of its request; the pipeline keeps each text's own rows.
    """
    if mask is None:
        return embeds[0]
    keep = mask[0].to(torch.bool)
    if not bool(keep.any()):
        raise ValueError("the embeddings' mask marks no token")
    return embeds[0][keep.to(embeds.device)]


class ZImageDenoiser:
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
            ZImageTransformer2DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=Z_IMAGE,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        # ZImagePipeline: 2 ** (len(block_out_channels) - 1), and 2x2 patches on top.
        self.vae_scale_factor = 2 ** (len(vae_config.get("block_out_channels", [128, 256, 512, 512])) - 1)
        self.cfg_truncation = CFG_TRUNCATION
        self.cfg_normalization = CFG_NORMALIZATION

    @property
    def experts(self) -> list[ZImageTransformer2DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.cap_feat_dim

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    def latent_size(self, spec: DenoiseSpec) -> tuple[int, int]:
        """Latent rows and columns, as ZImagePipeline.prepare_latents computes them."""
        return 2 * (spec.height // (self.vae_scale_factor * 2)), 2 * (spec.width // (self.vae_scale_factor * 2))

    def initial_noise(self, spec: DenoiseSpec) -> torch.Tensor:
        """The seed's float32 noise [1, C, h, w], drawn as ZImagePipeline draws it with
        generator=torch.Generator('cpu').manual_seed(seed)."""
        height, width = self.latent_size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = (1, self.latent_channels, height, width)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def timesteps(self, spec: DenoiseSpec, image_tokens: int) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """A fresh scheduler set to the request's steps, with ZImagePipeline's sigmas and shift."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        mu = calculate_shift(
            image_tokens,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        sigmas = get_default_z_image_sigmas(spec.num_inference_steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def _predict(
        self, latents: torch.Tensor, timestep: torch.Tensor, texts: list[torch.Tensor], branch: str
    ) -> torch.Tensor:
        """The transformer's output [B, C, 1, h, w] (float32) for `latents` [B, C, h, w], one text [L_b, dim] per
        image (the transformer takes each text at its own length, and masks the shorter ones in a batch).
        `branch` ("cond", "uncond") names no cache context: ZImageTransformer2DModel has none."""
        images = list(latents.to(self.transformer.dtype).unsqueeze(2))
        output = self.transformer(images, timestep, texts, return_dict=False)[0]
        return torch.stack([image.float() for image in output])

    def _guided(self, positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
        """ZImagePipeline's guidance of one image's predictions, with its renormalization."""
        prediction = positive + scale * (positive - negative)
        if self.cfg_normalization and float(self.cfg_normalization) > 0.0:
            positive_norm = torch.linalg.vector_norm(positive)
            guided_norm = torch.linalg.vector_norm(prediction)
            max_norm = positive_norm * float(self.cfg_normalization)
            if guided_norm > max_norm:
                prediction = prediction * (max_norm / guided_norm)
        return prediction

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns the latents as [1, C, 1, h, w]; on_step(step, total) after each.

        `conditioning`: "prompt_embeds" [1, L, dim] with, optionally, "prompt_embeds_mask" [1, L]; with
        guidance_scale > 0 also "negative_prompt_embeds" (and its mask).
        """
        dtype = self.transformer.dtype
        prompt = text_from_wire(conditioning["prompt_embeds"], conditioning.get("prompt_embeds_mask"))
        prompt = prompt.to(self.device, dtype)
        do_cfg = spec.do_classifier_free_guidance
        negative = None
        if do_cfg:
            if conditioning.get("negative_prompt_embeds") is None:
                raise ValueError("negative_prompt_embeds are required when guidance_scale > 0")
            negative = text_from_wire(
                conditioning["negative_prompt_embeds"], conditioning.get("negative_prompt_embeds_mask")
            ).to(self.device, dtype)

        latents = self.initial_noise(spec)
        scheduler, timesteps = self.timesteps(spec, (latents.shape[2] // 2) * (latents.shape[3] // 2))
        truncation_norms = None
        if do_cfg and self.cfg_truncation is not None and float(self.cfg_truncation) <= 1:
            truncation_norms = ((1000 - timesteps.float()) / 1000).tolist()

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            timestep = (1000 - t.expand(latents.shape[0])) / 1000
            scale = spec.guidance_scale
            if truncation_norms is not None and truncation_norms[i] > self.cfg_truncation:
                scale = 0.0
            predict = partial(self._predict, latents, timestep)
            if do_cfg and scale > 0:
                positive, negative_prediction = guidance_predictions(predict, [prompt], [negative], self.cfg_group)
                noise_pred = self._guided(positive, negative_prediction, scale)
            else:
                noise_pred = predict([prompt], "cond")
            noise_pred = -noise_pred.squeeze(2)
            latents = scheduler.step(noise_pred.to(torch.float32), t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        return latents.unsqueeze(2)

    @torch.no_grad()
    def denoise_batch(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[torch.Tensor | None]:
        """`denoise` for several requests of one batch_key (one size, step count and guidance branches) at once:
        one transformer pass per step and branch serves every request, each text at its own length (the
        transformer masks the shorter ones, as ZImagePipeline's batch of both branches). Each row is its
        request's own run: its seed's noise, its texts, and its guidance scale with the renormalization applied
        to its image alone. A member no longer wanted leaves the batch before the next step."""
        first = specs[0]
        dtype = self.transformer.dtype

        def texts(role: str) -> list[torch.Tensor]:
            return [
                text_from_wire(c[f"{role}_embeds"], c.get(f"{role}_embeds_mask")).to(self.device, dtype)
                for c in conditionings
            ]

        prompts = texts("prompt")
        negatives = texts("negative_prompt") if first.do_classifier_free_guidance else None
        scales = [spec.guidance_scale for spec in specs]
        latents = torch.cat([self.initial_noise(spec) for spec in specs])
        scheduler, timesteps = self.timesteps(first, (latents.shape[2] // 2) * (latents.shape[3] // 2))
        truncation_norms = None
        if negatives is not None and self.cfg_truncation is not None and float(self.cfg_truncation) <= 1:
            truncation_norms = ((1000 - timesteps.float()) / 1000).tolist()
        rows = BatchRows(len(specs))

        for i, t in enumerate(timesteps):
            kept = rows.before_step(wanted, self.parallel, self.device, scheduler)
            if kept is not None:
                latents, prompts, scales = latents[kept], [prompts[r] for r in kept], [scales[r] for r in kept]
                negatives = [negatives[r] for r in kept] if negatives is not None else None
            timestep = (1000 - t.expand(latents.shape[0])) / 1000
            truncated = truncation_norms is not None and truncation_norms[i] > self.cfg_truncation
            predict = partial(self._predict, latents, timestep)
            if negatives is not None and not truncated:
                positive, negative_prediction = guidance_predictions(predict, prompts, negatives, self.cfg_group)
                noise_pred = torch.cat(
                    [
                        self._guided(positive[row : row + 1], negative_prediction[row : row + 1], scale)
                        for row, scale in enumerate(scales)
                    ]
                )
            else:
                noise_pred = predict(prompts, "cond")
            noise_pred = -noise_pred.squeeze(2)
            latents = scheduler.step(noise_pred.to(torch.float32), t, latents, return_dict=False)[0]
            rows.stepped(on_step, i + 1, len(timesteps))
        return [None if row is None else row.unsqueeze(2) for row in rows.results(latents)]
