"""The Qwen-Image 2.1 denoising loop, step for step as QwenImage21Pipeline runs it for text-to-image.

What differs from Qwen-Image's loop (families/qwen_image/denoise.py, whose text conditioning this reuses):
- the latents are not patched: the noise [1, 1, C, h, w] (h = height / 16) is flattened to [1, h * w, C];
- the transformer reads one joint sequence, the text then the target image, and is told where the image sits by
  `img_mask`: one slot per text token (none of them an image for text-to-image) and then one per 2x2 group of
  the target's latent tokens;
- text tokens are modulated from t = 0 (`causal_condition`), so their keys and values do not change over the
  steps: the first step fills a KV cache per branch and later steps recompute the target image's tokens only,
  as the pipeline does with its default `use_kv_cache=True`;
- true CFG is the plain `negative + scale * (positive - negative)`, without Qwen-Image's norm rescale;
- the sigmas are the checkpoint's `sample_sigmas` (model_index.json) when it sets them, the pipeline's linspace
  otherwise, shifted by `mu` from the image's token count.
The noise is drawn from the seed as the pipeline draws it, so the latents equal the in-process pipeline's.

The request's `guidance_scale` is the pipeline's `true_cfg_scale`: above 1 (with the negative prompt's embeddings,
which the orchestrator always sends then) both branches run. CFG-parallel puts one branch, with its own cache, on
each rank of the group; HSDP shards the blocks' weights (parallel.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.qwen_image.denoise import QwenTextEmbeds
from families.qwen_image_21.family import QWEN_IMAGE_21
from families.qwen_image_21.parallel import parallelize
from stagekit.denoise import DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.errors import RequestError
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer

# QwenImage21Pipeline.vae_scale_factor: one latent token per 16x16 pixels; sides are cut to multiples of twice it.
VAE_SCALE_FACTOR = 16


class QwenImage21Denoiser:
    """The denoising loop on one rank; with CFG-parallel, each rank of the group runs one branch in step."""

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
            QwenImage21Transformer2DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=QWEN_IMAGE_21,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        index = json.loads((model_dir / "model_index.json").read_text())
        self.sample_sigmas: list[float] | None = index.get("sample_sigmas")
        self.vae_scale_factor = VAE_SCALE_FACTOR

    @property
    def experts(self) -> list[QwenImage21Transformer2DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        return self.transformer.config.context_in_dim

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    def latent_size(self, spec: DenoiseSpec) -> tuple[int, int]:
        """Latent rows and columns, as QwenImage21Pipeline.prepare_latents computes them."""
        return 2 * (spec.height // (self.vae_scale_factor * 2)), 2 * (spec.width // (self.vae_scale_factor * 2))

    def initial_noise(self, spec: DenoiseSpec, dtype: torch.dtype) -> torch.Tensor:
        """The seed's flattened noise [1, h * w, C], drawn as QwenImage21Pipeline draws it with
        generator=torch.Generator('cpu').manual_seed(seed)."""
        height, width = self.latent_size(spec)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        shape = (1, 1, self.latent_channels, height, width)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        return latents.view(1, self.latent_channels, height * width).transpose(1, 2)

    def sigmas(self, steps: int) -> list[float] | np.ndarray:
        """The checkpoint's sample_sigmas, or the pipeline's linspace; a request must run as many steps as they have."""
        if self.sample_sigmas is None:
            return np.linspace(1.0, 1 / steps, steps)
        if len(self.sample_sigmas) != steps:
            raise RequestError(
                f"num_inference_steps: this checkpoint samples with its {len(self.sample_sigmas)} sample_sigmas "
                f"(model_index.json), so a request runs {len(self.sample_sigmas)} steps, not {steps}"
            )
        return self.sample_sigmas

    def _predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        img_shapes: list,
        caches: dict[str, QwenImage21KVCache | None],
        kv_mode: str | None,
        text: QwenTextEmbeds,
        branch: str,
    ) -> torch.Tensor:
        # The pipeline's image_pad_mask: no text slot holds an image, then one slot per 2x2 target tokens.
        slots = torch.zeros(1, text.embeds.shape[1] + latents.shape[1] // 4, dtype=torch.bool, device=self.device)
        slots[:, text.embeds.shape[1] :] = True
        # A cache context per branch, as QwenImage21Pipeline keeps one (diffusers' cache hooks key on it).
        with self.transformer.cache_context(branch):
            prediction = self.transformer(
                hidden_states=latents,
                timestep=timestep / 1000,
                encoder_hidden_states=text.embeds,
                encoder_hidden_states_mask=text.mask,
                img_shapes=img_shapes,
                img_mask=slots,
                attention_kwargs={},
                kv_cache=caches[branch],
                kv_cache_mode=kv_mode,
                return_dict=False,
            )[0]
        return prediction[:, -latents.shape[1] :]

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns the latents unflattened to [1, C, 1, h, w]; on_step(step, total) after each.

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

        height, width = self.latent_size(spec)
        latents = self.initial_noise(spec, dtype)
        img_shapes = [[(1, height, width)]]

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        sigmas = self.sigmas(spec.num_inference_steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        # The text's keys and values are step-independent only under causal_condition, as the pipeline checks.
        cached = bool(self.transformer.config.causal_condition)
        blocks = len(self.transformer.transformer_blocks)
        caches = {branch: QwenImage21KVCache(blocks) if cached else None for branch in ("cond", "uncond")}

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            kv_mode = ("extract" if i == 0 else "cached") if cached else None
            predict = partial(self._predict, latents, timestep, img_shapes, caches, kv_mode)
            if not do_true_cfg:
                noise_pred = predict(prompt, "cond")
            else:
                noise_pred, neg_noise_pred = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = neg_noise_pred + spec.guidance_scale * (noise_pred - neg_noise_pred)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            on_step(i + 1, len(timesteps))
        return latents.transpose(1, 2).reshape(1, self.latent_channels, 1, height, width)
