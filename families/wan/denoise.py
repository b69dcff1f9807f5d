"""The Wan denoising loop, step for step as WanPipeline runs it.

The initial noise, the scheduler (the checkpoint's own, fresh per request since
multistep schedulers keep state), classifier-free guidance with the negative
prompt and the per-step dtype casts all follow WanPipeline, so that the latents
equal what the in-process pipeline computes for the same arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import diffusers
import torch
from diffusers import WanTransformer3DModel
from diffusers.utils.torch_utils import randn_tensor

from families.wan.parallel import parallelize
from stagekit.batch_invariance import rows_apart
from stagekit.denoise import BatchRows, DenoiseSpec, guidance_predictions, guide_rows, stop_if_cancelled
from stagekit.denoise_steps import DenoiseRun, DenoiseState, request_digest, run_to_end
from stagekit.gguf import load_gguf_transformer
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig, build_mesh
from stagekit.parallel.mesh import device_type_for
from stagekit.weights import load_pretrained

# Modules whose kernels give a row other bits in a batch than alone (the timestep embedding's matrix-vector products,
# the patch embedding's 3D convolution), run row by row in a batched pass so that each row equals its pass alone
# (stagekit/batch_invariance.py).
ROW_WISE_MODULES = ("condition_embedder", "patch_embedding")


@dataclass
class WanRun(DenoiseRun):
    """A Wan request being denoised step by step: its embeddings on the device and the A14B expert boundary."""

    prompt_embeds: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    negative_prompt_embeds: torch.Tensor | None = None
    boundary_timestep: float | None = None


class WanDenoiser:
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
        index = json.loads((model_dir / "model_index.json").read_text())
        self.device = device
        self.parallel = parallel if parallel is not None and parallel.total_ranks > 1 else None
        mesh = build_mesh(self.parallel, device_type_for(device)) if self.parallel is not None else None
        load = partial(load_pretrained, device=device, dtype=dtype, num_threads=load_threads)
        if options is not None and options.quantization == "gguf":
            load = partial(load_gguf_transformer, device=device, dtype=dtype)
        elif self.parallel is not None and self.parallel.shards_weights:
            # Tensor parallelism and HSDP are applied to the empty model, so that each rank reads only its shards.
            load = partial(load, shard_model=partial(parallelize, config=self.parallel, mesh=mesh, device=device))
        self.transformer = load(WanTransformer3DModel, model_dir / "transformer").eval()
        # Wan2.2 A14B: a second expert takes the low-noise steps, below boundary_ratio * num_train_timesteps.
        self.transformer_2: WanTransformer3DModel | None = None
        if index.get("transformer_2", [None, None])[1] is not None and (model_dir / "transformer_2").is_dir():
            self.transformer_2 = load(WanTransformer3DModel, model_dir / "transformer_2").eval()
        self.boundary_ratio: float | None = index.get("boundary_ratio")
        if options is not None:
            options.apply(self.experts, device, load_threads)
        scheduler_class = getattr(diffusers, index["scheduler"][1])
        self.scheduler_config = scheduler_class.load_config(model_dir / "scheduler")
        self.scheduler_class = scheduler_class
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        self.vae_scale_spatial = vae_config.get("scale_factor_spatial", 8)
        self.vae_scale_temporal = vae_config.get("scale_factor_temporal", 4)
        self.cfg_group = None
        if self.parallel is not None:
            assert mesh is not None  # built whenever parallel is set
            if not self.parallel.shards_weights:
                for expert in self.experts:
                    parallelize(expert, self.parallel, mesh, device)
            if self.parallel.cfg_degree > 1:
                self.cfg_group = mesh["cfg"].get_group()

    @property
    def experts(self) -> list[WanTransformer3DModel]:
        return [self.transformer] if self.transformer_2 is None else [self.transformer, self.transformer_2]

    def expert_for(self, t: torch.Tensor, boundary_timestep: float | None) -> WanTransformer3DModel:
        """WanPipeline's switch: the first expert at and above the boundary, the second below it."""
        if boundary_timestep is None or self.transformer_2 is None or t >= boundary_timestep:
            return self.transformer
        return self.transformer_2

    @property
    def text_dim(self) -> int:
        return self.transformer.config.text_dim

    def latent_shape(self, spec: DenoiseSpec) -> tuple[int, int, int, int, int]:
        return (
            1,
            self.transformer.config.in_channels,
            (spec.num_frames - 1) // self.vae_scale_temporal + 1,
            spec.height // self.vae_scale_spatial,
            spec.width // self.vae_scale_spatial,
        )

    def initial_noise(self, spec: DenoiseSpec) -> torch.Tensor:
        """The seed's noise, drawn as WanPipeline draws it with generator=torch.Generator('cpu').manual_seed(seed)."""
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        return randn_tensor(self.latent_shape(spec), generator=generator, device=self.device, dtype=torch.float32)

    @staticmethod
    def _predict(
        model: WanTransformer3DModel, latents: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor, branch: str
    ) -> torch.Tensor:
        # A cache context per branch, as WanPipeline keeps one (diffusers' cache hooks key on it).
        with model.cache_context(branch):
            return model(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]

    def guided_prediction(
        self,
        predict: Callable[[torch.Tensor, str], torch.Tensor],
        spec: DenoiseSpec,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """One step's noise prediction: the prompt's, or with CFG uncond + scale * (cond - uncond), as WanPipeline."""
        if not spec.do_classifier_free_guidance:
            return predict(prompt_embeds, "cond")
        noise_pred, noise_uncond = guidance_predictions(predict, prompt_embeds, negative_prompt_embeds, self.cfg_group)
        return noise_uncond + spec.guidance_scale * (noise_pred - noise_uncond)

    def begin(
        self, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor], state: DenoiseState | None = None
    ) -> WanRun:
        """A run of the request at step 0 (the seed's noise, a fresh scheduler), or continued from `state`.

        `conditioning`: "prompt_embeds" [1, L, text_dim] and, with guidance_scale > 1, "negative_prompt_embeds".
        """
        transformer_dtype = self.transformer.dtype
        prompt_embeds = conditioning["prompt_embeds"].to(self.device, transformer_dtype)
        negative_prompt_embeds = None
        if spec.do_classifier_free_guidance:
            if conditioning.get("negative_prompt_embeds") is None:
                raise ValueError("negative_prompt_embeds are required when guidance_scale > 1")
            negative_prompt_embeds = conditioning["negative_prompt_embeds"].to(self.device, transformer_dtype)
        scheduler = self.scheduler_class.from_config(self.scheduler_config)
        scheduler.set_timesteps(spec.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        boundary_timestep = None
        if self.boundary_ratio is not None:
            boundary_timestep = self.boundary_ratio * scheduler.config.num_train_timesteps
        run = WanRun(
            spec=spec,
            latents=self.initial_noise(spec) if state is None else torch.empty(0),
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            digest=request_digest(spec, conditioning, type(scheduler).__name__),
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            boundary_timestep=boundary_timestep,
        )
        if state is not None:
            run.latents = torch.empty(self.latent_shape(spec), dtype=torch.float32, device=self.device)
            run.restore(state)
        return run

    def step(self, runs: list[WanRun]) -> None:
        """One step of each run: the runs at the same expert share one transformer pass per guidance branch, each
        row at its own timestep; each run's scheduler steps its own row. One run alone computes what WanPipeline's
        loop computes for that step."""
        by_expert: dict[int, list[WanRun]] = {}
        for run in runs:
            expert = self.expert_for(run.timesteps[run.step_index], run.boundary_timestep)
            by_expert.setdefault(id(expert), []).append(run)
        for group in by_expert.values():
            self._step_group(group)

    def _step_group(self, runs: list[WanRun]) -> None:
        transformer_dtype = self.transformer.dtype
        ts = [run.timesteps[run.step_index] for run in runs]
        model = self.expert_for(ts[0], runs[0].boundary_timestep)
        latents = torch.cat([run.latents for run in runs]) if len(runs) > 1 else runs[0].latents
        latent_model_input = latents.to(transformer_dtype)
        if self.expand_timesteps:
            if len(runs) > 1:
                raise ValueError("runs with per-token timesteps step one at a time")
            mask = torch.ones(latents.shape, dtype=torch.float32, device=self.device)
            timestep = (mask[0][0][:, ::2, ::2] * ts[0]).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        elif len(runs) == 1:
            timestep = ts[0].expand(latents.shape[0])
        else:
            timestep = torch.stack(ts)
        # guidance_scale_2 of WanPipeline is not exposed: both experts use the request's guidance scale.
        predict = partial(self._predict, model, latent_model_input, timestep)
        prompt_embeds = torch.cat([run.prompt_embeds for run in runs]) if len(runs) > 1 else runs[0].prompt_embeds
        with rows_apart(model, ROW_WISE_MODULES, len(runs)):
            noise_pred = self._group_prediction(runs, predict, prompt_embeds)
        for row, (run, t) in enumerate(zip(runs, ts, strict=True)):
            prediction = noise_pred if len(runs) == 1 else noise_pred[row : row + 1]
            run.latents = run.scheduler.step(prediction, t, run.latents, return_dict=False)[0]
            run.step_index += 1

    def result(self, run: WanRun) -> torch.Tensor:
        """A finished run's latents, as `denoise` returns them."""
        return run.latents

    def _group_prediction(
        self, runs: list[WanRun], predict: Callable[[torch.Tensor, str], torch.Tensor], prompt_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The guided noise prediction of the runs' rows, each with its own guidance scale."""
        if len(runs) == 1:
            return self.guided_prediction(predict, runs[0].spec, runs[0].prompt_embeds, runs[0].negative_prompt_embeds)
        if not runs[0].spec.do_classifier_free_guidance:
            noise_pred = predict(prompt_embeds, "cond")
        else:
            negative = torch.cat([run.negative_prompt_embeds for run in runs if run.negative_prompt_embeds is not None])
            noise_cond, noise_uncond = guidance_predictions(predict, prompt_embeds, negative, self.cfg_group)
            noise_pred = guide_rows(noise_cond, noise_uncond, [run.spec.guidance_scale for run in runs])
        return noise_pred

    @torch.no_grad()
    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns float32 latents [1, C, T, h, w]; on_step(step, total) after each.

        `conditioning`: "prompt_embeds" [1, L, text_dim] and, with guidance_scale > 1, "negative_prompt_embeds".
        """
        run = self.begin(spec, conditioning)
        run_to_end(self.step, run, on_step, lambda run: stop_if_cancelled(cancelled, self.parallel, self.device))
        return self.result(run)

    @torch.no_grad()
    def denoise_batch(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[torch.Tensor | None]:
        """`denoise` for several requests of one batch_key (dit_svc/denoise.py) at once: their latents, prompts
        and guidance scales are stacked along the batch, so each transformer pass serves every request.

        Each row is its request's own run: its seed's noise, its embeddings and its guidance scale, the
        scheduler stepping every row with the same timesteps. A member that is no longer wanted is dropped
        before the next step (its row leaves the latents, the embeddings and the scheduler's history).
        """
        first = specs[0]
        transformer_dtype = self.transformer.dtype
        prompt_embeds = torch.cat([c["prompt_embeds"] for c in conditionings]).to(self.device, transformer_dtype)
        negative_prompt_embeds = None
        if first.do_classifier_free_guidance:
            negative = [c["negative_prompt_embeds"] for c in conditionings]
            negative_prompt_embeds = torch.cat(negative).to(self.device, transformer_dtype)
        guidance = [spec.guidance_scale for spec in specs]

        scheduler = self.scheduler_class.from_config(self.scheduler_config)
        scheduler.set_timesteps(first.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        latents = torch.cat([self.initial_noise(spec) for spec in specs])
        boundary_timestep = None
        if self.boundary_ratio is not None:
            boundary_timestep = self.boundary_ratio * scheduler.config.num_train_timesteps
        rows = BatchRows(len(specs))

        for i, t in enumerate(timesteps):
            kept = rows.before_step(wanted, self.parallel, self.device, scheduler)
            if kept is not None:
                latents, prompt_embeds = latents[kept], prompt_embeds[kept]
                guidance = [guidance[row] for row in kept]
                if negative_prompt_embeds is not None:
                    negative_prompt_embeds = negative_prompt_embeds[kept]
            latent_model_input = latents.to(transformer_dtype)
            timestep = t.expand(latents.shape[0])
            model = self.expert_for(t, boundary_timestep)
            predict = partial(self._predict, model, latent_model_input, timestep)
            with rows_apart(model, ROW_WISE_MODULES, latents.shape[0]):
                if negative_prompt_embeds is None:
                    noise_pred = predict(prompt_embeds, "cond")
                else:
                    noise_cond, noise_uncond = guidance_predictions(
                        predict, prompt_embeds, negative_prompt_embeds, self.cfg_group
                    )
                    noise_pred = guide_rows(noise_cond, noise_uncond, guidance)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            rows.stepped(on_step, i + 1, len(timesteps))
        return rows.results(latents)
