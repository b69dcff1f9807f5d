"""The FLUX.2 klein denoising loop, step for step as Flux2KleinPipeline runs it.

The noise is drawn from the seed as the pipeline draws it, already in the transformer's layout
[1, 4C, h/2, w/2] (2x2 patches of the VAE's C latent channels), and packed into a [1, h/2 * w/2, 4C] sequence with
4-D position ids (0, row, column, 0); the text's ids are (0, 0, 0, token). The scheduler's sigmas are the
pipeline's linspace, shifted by its empirical `mu` (`compute_empirical_mu` of the image's token count and the step
count), and the transformer gets `timestep / 1000` and no guidance embedding. The final latents are unpacked by
their ids to [1, 4C, 1, h/2, w/2], still normalised: the VAE stage de-normalises and unpatchifies them
(decode.py), as the pipeline does after its loop.

Guidance follows model_index.json's `is_distilled`, as the pipeline's `do_classifier_free_guidance`: the
step-distilled model runs one pass per step and ignores `guidance_scale`; the base model above 1 runs the prompt
and the negative prompt (the orchestrator then sends its embeddings) and combines them as
`negative + scale * (positive - negative)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.flux2_klein.checkpoint import is_distilled, vae_scale_factor
from families.flux2_klein.family import FLUX2_KLEIN
from families.flux2_klein.parallel import parallelize
from stagekit.denoise import DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer

logger = logging.getLogger(__name__)


class KleinText:
    """One text's conditioning as the transformer takes it: the embeddings [1, L, dim] and their position ids
    [1, L, 4], (0, 0, 0, token) as Flux2KleinPipeline._prepare_text_ids makes them."""

    def __init__(self, embeds: torch.Tensor) -> None:
        self.embeds = embeds
        self.ids = Flux2KleinPipeline._prepare_text_ids(embeds).to(embeds.device)

    @classmethod
    def from_conditioning(
        cls, conditioning: dict[str, torch.Tensor], name: str, device: torch.device, dtype: torch.dtype
    ) -> KleinText:
        return cls(conditioning[name].to(device, dtype))


class Flux2KleinDenoiser:
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
            Flux2Transformer2DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=FLUX2_KLEIN,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        self.is_distilled = is_distilled(json.loads((model_dir / "model_index.json").read_text()))
        self.vae_scale_factor = vae_scale_factor(json.loads((model_dir / "vae" / "config.json").read_text()))

    @property
    def experts(self) -> list[Flux2Transformer2DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.joint_attention_dim

    @property
    def latent_channels(self) -> int:
        """Channels of the transformer's latents: the VAE's, patchified 2x2."""
        return self.transformer.config.in_channels

    def latent_size(self, spec: DenoiseSpec) -> tuple[int, int]:
        """Rows and columns of the patchified latents, as Flux2KleinPipeline.prepare_latents computes them."""
        multiple = self.vae_scale_factor * 2
        return spec.height // multiple, spec.width // multiple

    def initial_noise(self, spec: DenoiseSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The seed's packed noise [1, h * w, 4C], drawn as the pipeline draws it with
        generator=torch.Generator('cpu').manual_seed(seed), and the image tokens' position ids [1, h * w, 4]."""
        height, width = self.latent_size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = (1, self.latent_channels, height, width)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        ids = Flux2KleinPipeline._prepare_latent_ids(latents).to(self.device)
        return Flux2KleinPipeline._pack_latents(latents), ids

    def timesteps(self, spec: DenoiseSpec, image_tokens: int) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """A fresh scheduler set to the request's steps, with the pipeline's sigmas and empirical shift."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = spec.num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=image_tokens, num_steps=steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def runs_cfg(self, spec: DenoiseSpec) -> bool:
        """Flux2KleinPipeline.do_classifier_free_guidance: guidance above 1 on the base model only."""
        return spec.do_classifier_free_guidance and not self.is_distilled

    def _predict(
        self, latents: torch.Tensor, image_ids: torch.Tensor, timestep: torch.Tensor, text: KleinText, branch: str
    ) -> torch.Tensor:
        # A cache context per branch, as the pipeline keeps one (diffusers' cache hooks key on it).
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents.to(self.transformer.dtype),
                timestep=timestep / 1000,
                guidance=None,
                encoder_hidden_states=text.embeds,
                txt_ids=text.ids,
                img_ids=image_ids,
                joint_attention_kwargs=None,
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
        """Runs every step and returns the normalised, patchified latents [1, 4C, 1, h, w]; on_step(step, total)
        after each.

        `conditioning`: "prompt_embeds" [1, L, dim]; with CFG on the base model also "negative_prompt_embeds".
        """
        dtype = self.transformer.dtype
        prompt = KleinText.from_conditioning(conditioning, "prompt_embeds", self.device, dtype)
        do_cfg = self.runs_cfg(spec)
        if spec.do_classifier_free_guidance and self.is_distilled:
            logger.warning("guidance_scale %s is ignored: this klein model is step-distilled", spec.guidance_scale)
        negative = None
        if do_cfg:
            if conditioning.get("negative_prompt_embeds") is None:
                raise ValueError("negative_prompt_embeds are required when guidance_scale > 1 (CFG)")
            negative = KleinText.from_conditioning(conditioning, "negative_prompt_embeds", self.device, dtype)

        latents, image_ids = self.initial_noise(spec, dtype)
        scheduler, timesteps = self.timesteps(spec, latents.shape[1])
        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            predict = partial(self._predict, latents, image_ids, timestep)
            if not do_cfg:
                noise_pred = predict(prompt, "cond")
            else:
                noise_pred, neg_noise_pred = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = neg_noise_pred + spec.guidance_scale * (noise_pred - neg_noise_pred)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        height, width = self.latent_size(spec)
        unpacked = Flux2KleinPipeline._unpack_latents_with_ids(latents, image_ids, height, width)
        return unpacked.unsqueeze(2)
