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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.qwen_image.family import QWEN_IMAGE
from families.qwen_image.parallel import parallelize
from stagekit.batch_invariance import rows_apart
from stagekit.denoise import DenoiseSpec, guidance_predictions, stop_if_cancelled
from stagekit.denoise_steps import DenoiseRun, DenoiseState, request_digest, run_to_end
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


def padded_texts(texts: list[QwenTextEmbeds]) -> QwenTextEmbeds:
    """Several runs' texts as one batch: padded with zeros to the longest, each with its mask (ones where it has
    none), the padding masked out; texts of one length and no mask stay as they are."""
    length = max(text.embeds.shape[1] for text in texts)
    if all(text.mask is None and text.embeds.shape[1] == length for text in texts):
        return QwenTextEmbeds(torch.cat([text.embeds for text in texts]), None)
    embeds, masks = [], []
    for text in texts:
        pad = length - text.embeds.shape[1]
        embeds.append(torch.nn.functional.pad(text.embeds, (0, 0, 0, pad)))
        mask = text.mask if text.mask is not None else torch.ones(text.embeds.shape[:2], dtype=torch.long)
        masks.append(torch.nn.functional.pad(mask.to(text.embeds.device, torch.long), (0, pad)))
    return QwenTextEmbeds(torch.cat(embeds), torch.cat(masks))


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """QwenImagePipeline's true CFG row by row, each with its request's scale as a Python number: the combined
    prediction rescaled to the norm of the conditional one, per token."""
    rows = []
    for row, scale in enumerate(scales):
        positive = cond[row : row + 1] if len(scales) > 1 else cond
        negative = uncond[row : row + 1] if len(scales) > 1 else uncond
        combined = negative + scale * (positive - negative)
        cond_norm = torch.norm(positive, dim=-1, keepdim=True)
        noise_norm = torch.norm(combined, dim=-1, keepdim=True)
        rows.append(combined * (cond_norm / noise_norm))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


@dataclass
class QwenImageRun(DenoiseRun):
    """A Qwen-Image request being denoised step by step: its texts on the device and its latent grid."""

    prompt: QwenTextEmbeds | None = None
    negative: QwenTextEmbeds | None = None
    img_shapes: list = field(default_factory=list)


# Modules fed one vector per request (the timestep embedding, the blocks' and the output norm's modulation), run
# row by row in a batched pass so that each row equals its pass alone (stagekit/batch_invariance.py).
ROW_WISE_MODULES = ("time_text_embed", "transformer_blocks.*.img_mod", "transformer_blocks.*.txt_mod", "norm_out")


class QwenImageDenoiser:
    """The denoising loop on one rank; with a parallel layout, every rank of the group runs it in step. Its loop is
    written as steps (stagekit/denoise_steps.py), so the DiT stage may yield, resume and batch it at the step."""

    runs_steps: ClassVar[bool] = True

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

    def begin(
        self, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor], state: DenoiseState | None = None
    ) -> QwenImageRun:
        """A run of the request at step 0 (the seed's packed noise, the shifted schedule), or continued from `state`.

        `conditioning`: "prompt_embeds" [1, L, dim] with, optionally, "prompt_embeds_mask" [1, L]; with
        guidance_scale > 1 also "negative_prompt_embeds" (and its mask).
        """
        dtype = self.transformer.dtype
        prompt = QwenTextEmbeds.from_conditioning(conditioning, "prompt_embeds").to(self.device, dtype)
        negative = None
        if spec.do_classifier_free_guidance:
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
        run = QwenImageRun(
            spec=spec,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            digest=request_digest(spec, conditioning, type(scheduler).__name__),
            prompt=prompt,
            negative=negative,
            img_shapes=img_shapes,
        )
        if state is not None:
            run.restore(state)
        return run

    def step(self, runs: list[QwenImageRun]) -> None:
        """One step of each run: one transformer pass per guidance branch for all of them, each row at its own
        timestep with its own texts (padded to the longest, with masks); each run's scheduler steps its own row.
        One run alone computes what QwenImagePipeline's loop computes for that step."""
        ts = [run.timesteps[run.step_index] for run in runs]
        if len(runs) == 1:
            latents = runs[0].latents
            timestep = ts[0].expand(latents.shape[0]).to(latents.dtype)
            prompt, negative, img_shapes = runs[0].prompt, runs[0].negative, runs[0].img_shapes
        else:
            latents = torch.cat([run.latents for run in runs])
            timestep = torch.stack(ts).to(latents.dtype)
            prompt = padded_texts([run.prompt for run in runs])  # type: ignore[misc]
            negative = None
            if runs[0].spec.do_classifier_free_guidance:
                negative = padded_texts([run.negative for run in runs])  # type: ignore[misc]
            img_shapes = [shape for run in runs for shape in run.img_shapes]
        assert prompt is not None  # begin sets every run's texts
        predict = partial(self._predict, latents, timestep, img_shapes)
        with rows_apart(self.transformer, ROW_WISE_MODULES, len(runs)):
            if not runs[0].spec.do_classifier_free_guidance:
                noise_pred = predict(prompt, "cond")
            else:
                assert negative is not None  # every run with CFG has its negative texts (begin checks them)
                noise_cond, noise_uncond = guidance_predictions(predict, prompt, negative, self.cfg_group)
                noise_pred = true_cfg(noise_cond, noise_uncond, [run.spec.guidance_scale for run in runs])
        for row, (run, t) in enumerate(zip(runs, ts, strict=True)):
            prediction = noise_pred if len(runs) == 1 else noise_pred[row : row + 1]
            run.latents = run.scheduler.step(prediction, t, run.latents, return_dict=False)[0]
            run.step_index += 1

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
        run = self.begin(spec, conditioning)
        run_to_end(self.step, run, on_step, lambda run: stop_if_cancelled(cancelled, self.parallel, self.device))
        return self.result(run)

    def result(self, run: QwenImageRun) -> torch.Tensor:
        """A finished run's latents unpacked from tokens to [1, C, 1, h, w], as `denoise` returns them."""
        return QwenImagePipeline._unpack_latents(run.latents, run.spec.height, run.spec.width, self.vae_scale_factor)
