"""The LTX-2 denoising loop: video and audio latents denoised together, step for step as LTX2Pipeline runs it.

Latents. The video latents [1, C, T, h, w] (T = (frames - 1) / 8 + 1, h and w a 32nd of the size) and then the
audio latents [1, Ca, A, M] (A = round(frames / frame_rate * 25): 16 kHz mel frames with a hop of 160, 4x
compressed; M = the audio VAE's mel bins / 4) are drawn in that order from one generator seeded with the request's
seed, in float32, as the pipeline draws them with generator=torch.Generator("cpu").manual_seed(seed). Both are
packed into token sequences ([1, T*h*w, C] and [1, A, Ca*M]) and stay float32; the transformer takes them in its
own dtype and returns a velocity for each.

Schedule. Two FlowMatchEulerDiscreteSchedulers from the checkpoint's config, one per modality, with the
pipeline's sigmas linspace(1, 1/steps, steps) shifted by `mu` from the video's token count (calculate_shift with
the config's base and max sequence lengths and shifts).

Guidance. Each step runs the passes LTX2Pipeline's guidance asks for (CFG's negative prompt, STG, modality
isolation) and combines them in x0 space, each modality with its own scales (families/ltx2/guidance.py; the
request's guidance_scale is the video's CFG scale, the rest `LTX2Guidance`, the pipeline's defaults), then turns
the guided x0 back into a velocity for each modality's scheduler.

The passes run as the pipeline runs them: CFG's negative and positive prompt as one batch of two (negative first),
then the positive prompt alone for STG and for modality guidance. (A CFG-parallel layout would give each rank one
row of that batch; the family's parallel plan is HSDP only (families/ltx2/parallel.py), so
`stagekit.denoise.guidance_predictions`, which runs the branches one by one, is not used.) The text arrives already
through the connectors (families/ltx2/encode.py). The result is what `LTX2Pipeline(output_type="latent")` returns:
the video latents unpacked and de-normalised with the video VAE's latents_mean / latents_std and scaling_factor, and
the audio latents de-normalised with the audio VAE's statistics and unpacked to [1, Ca, A, M].

Image-to-video (LTX2ImageToVideoPipeline, `ltx-2-i2v`). The VAE stage's Encode sends the first frame's normalised
latents ("image_latents" [1, C, 1, h, w], families/ltx2/vae_encode.py). The loop starts from them at latent frame 0
and from the seed's noise at the others (the same draws as text-to-video: the pipeline encodes the image with the
mode of the VAE's distribution, which draws nothing). Every pass gives the first frame's tokens timestep 0 (the
pipeline's per-token `timestep * (1 - conditioning_mask)`) and the audio the step's timestep; the guidance is
text-to-video's, over every token, and the scheduler steps only the later frames, so the first stays the image's.

Left out: `num_frames=None` (the pipeline's duration head, which LTX-2.0 and LTX-2.3 checkpoints do not have:
every request here names its frames), the prompt enhancer (off by default), given latents and noise_scale, and
custom sigmas or timesteps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from families.ltx2.checkpoint import FPS, compression
from families.ltx2.family import LTX2
from families.ltx2.guidance import (
    LTX2Guidance,
    ModalityScales,
    Predictions,
    VideoAudio,
    runs_cfg,
    runs_modality,
    runs_stg,
)
from families.ltx2.loop_values import LatentGrid, LTX2Text, Statistics, Step
from families.ltx2.parallel import parallelize
from stagekit.denoise import DenoiseSpec, stop_if_cancelled
from stagekit.model_options import TransformerOptions
from stagekit.parallel import ParallelConfig
from stagekit.parallel.load import load_parallel_transformer


class LTX2Denoiser:
    """The joint video and audio denoising loop on one rank, or on one rank of an HSDP group (families/ltx2/parallel.py:
    every rank runs the same loop with its shards of the transformer)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        parallel: ParallelConfig | None = None,
        options: TransformerOptions | None = None,
        load_threads: int = 4,
        guidance: LTX2Guidance | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        self.device = device
        loaded = load_parallel_transformer(
            LTX2VideoTransformer3DModel,
            model_dir / "transformer",
            device,
            dtype,
            family=LTX2,
            parallelize=parallelize,
            parallel=parallel,
            options=options,
            load_threads=load_threads,
        )
        self.transformer = loaded.transformer
        self.parallel, self.cfg_group = loaded.parallel, loaded.cfg_group
        self.guidance = guidance if guidance is not None else LTX2Guidance()
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler")
        vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
        self.vae_scale_spatial, self.vae_scale_temporal = compression(vae_config)
        self.latent_channels = int(vae_config.get("latent_channels", 128))
        self.scaling_factor = float(vae_config.get("scaling_factor", 1.0))
        self.video_statistics = Statistics.read(model_dir / "vae")
        audio_config = json.loads((model_dir / "audio_vae" / "config.json").read_text())
        self.audio_channels = int(audio_config.get("latent_channels", 8))
        self.mel_bins = int(audio_config.get("mel_bins", 64))
        # Audio latent frames per second: mel frames per second (sample rate over hop) over the audio VAE's 4x.
        self.audio_latents_per_second = (
            audio_config.get("sample_rate", 16000)
            / audio_config.get("mel_hop_length", 160)
            / float(LATENT_DOWNSAMPLE_FACTOR)
        )
        self.audio_statistics = Statistics.read(model_dir / "audio_vae")

    @property
    def experts(self) -> list[LTX2VideoTransformer3DModel]:
        return [self.transformer]

    @property
    def text_dim(self) -> int:
        """The width of the video text embeddings: Gemma's (LTX-2.0, projected by the transformer) or the video
        stream's (LTX-2.3)."""
        config = self.transformer.config
        return config.caption_channels if config.use_prompt_embeddings else config.cross_attention_dim

    @property
    def audio_text_dim(self) -> int:
        """The width of the audio text embeddings: Gemma's (LTX-2.0) or the audio stream's (LTX-2.3)."""
        config = self.transformer.config
        return config.caption_channels if config.use_prompt_embeddings else config.audio_cross_attention_dim

    def latent_grid(self, spec: DenoiseSpec, frame_rate: float) -> LatentGrid:
        """As LTX2Pipeline computes them. Raises ValueError for a height or width that is not a whole number of latent
        patches (the pipeline refuses sizes that are not multiples of 32, which that is for the published VAE)."""
        config = self.transformer.config
        multiple = self.vae_scale_spatial * config.patch_size
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(f"height and width must be multiples of {multiple}, not {spec.height} and {spec.width}")
        duration = spec.num_frames / frame_rate
        return LatentGrid(
            frames=(spec.num_frames - 1) // self.vae_scale_temporal + 1,
            height=spec.height // self.vae_scale_spatial,
            width=spec.width // self.vae_scale_spatial,
            audio_frames=round(duration * self.audio_latents_per_second),
            mel_bins=self.mel_bins // LATENT_DOWNSAMPLE_FACTOR,
        )

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """Image-to-video's first frame latents [1, C, 1, h, w] (from the VAE stage's Encode)."""
        if spec.image_roles != ("first_frame",) or name != "image_latents":
            return None
        height, width = spec.height // self.vae_scale_spatial, spec.width // self.vae_scale_spatial
        return (1, self.latent_channels, 1, height, width)

    def first_frame_conditioned(
        self, noise: torch.Tensor, image_latents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(initial video latents [1, C, T, h, w], packed conditioning mask [1, tokens]): the image's latents at frame
        0 and the noise at the others, as LTX2ImageToVideoPipeline.prepare_latents mixes them."""
        if image_latents.shape != (*noise.shape[:2], 1, *noise.shape[3:]):
            raise ValueError(
                f"image_latents: shape {list(image_latents.shape)} does not fit the request's latents "
                f"{list(noise.shape)}; expected [1, C, 1, h, w]"
            )
        image = image_latents.to(self.device, torch.float32).repeat(1, 1, noise.shape[2], 1, 1)
        mask = torch.zeros((1, 1, *noise.shape[2:]), device=self.device, dtype=torch.float32)
        mask[:, :, 0] = 1.0
        latents = image * mask + noise * (1 - mask)
        return latents, self.pack_video(mask).squeeze(-1)

    def step_video(
        self,
        scheduler: FlowMatchEulerDiscreteScheduler,
        velocity: torch.Tensor,
        t: torch.Tensor,
        latents: torch.Tensor,
        grid: LatentGrid,
        conditioned: bool,
    ) -> torch.Tensor:
        """The scheduler's step of the packed video latents; with a conditioned first frame only the later frames
        step and the first is kept, as the image-to-video pipeline steps them."""
        if not conditioned:
            return scheduler.step(velocity, t, latents, return_dict=False)[0]
        velocity, latents = self.unpack_video(velocity, grid), self.unpack_video(latents, grid)
        stepped = scheduler.step(velocity[:, :, 1:], t, latents[:, :, 1:], return_dict=False)[0]
        return self.pack_video(torch.cat([latents[:, :, :1], stepped], dim=2))

    def initial_noise(self, spec: DenoiseSpec, grid: LatentGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """The seed's video noise [1, C, T, h, w] and then audio noise [1, Ca, A, M], float32, drawn from one
        generator as the pipeline draws them."""
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        video_shape = (1, self.latent_channels, grid.frames, grid.height, grid.width)
        video = randn_tensor(video_shape, generator=generator, device=self.device, dtype=torch.float32)
        audio_shape = (1, self.audio_channels, grid.audio_frames, grid.mel_bins)
        audio = randn_tensor(audio_shape, generator=generator, device=self.device, dtype=torch.float32)
        return video, audio

    def pack_video(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, T, h, w] -> [B, T/pt * h/p * w/p, C * pt * p * p], the tokens in frame, row, column order."""
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        batch, channels, frames, height, width = latents.shape
        patches = latents.reshape(batch, channels, frames // pt, pt, height // p, p, width // p, p)
        return patches.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def unpack_video(self, tokens: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        """The inverse of `pack_video` for the request's grid."""
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        frames, height, width = grid.frames // pt, grid.height // p, grid.width // p
        patches = tokens.reshape(tokens.shape[0], frames, height, width, -1, pt, p, p)
        return patches.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @staticmethod
    def pack_audio(latents: torch.Tensor) -> torch.Tensor:
        """[B, Ca, A, M] -> [B, A, Ca * M]: one token per audio latent frame."""
        return latents.transpose(1, 2).flatten(2, 3)

    @staticmethod
    def unpack_audio(tokens: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        return tokens.unflatten(2, (-1, grid.mel_bins)).transpose(1, 2)

    def schedulers(
        self, steps: int, video_tokens: int
    ) -> tuple[FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """(video scheduler, audio scheduler, timesteps): both set to the pipeline's shifted sigmas."""
        video_scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        audio_scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        config = video_scheduler.config
        mu = calculate_shift(
            video_tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(audio_scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        timesteps, _ = retrieve_timesteps(video_scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        video_scheduler.set_begin_index(0)
        audio_scheduler.set_begin_index(0)
        return video_scheduler, audio_scheduler, timesteps

    def _predict(
        self,
        step: Step,
        text: LTX2Text,
        branch: str,
        *,
        isolate_modalities: bool = False,
        stg_blocks: list[int] | None = None,
    ) -> VideoAudio:
        """The transformer's (video, audio) velocities in float32 for `text` (a batch of one or more texts, the
        latents repeated for each). The branch names are the pipeline's cache contexts, which diffusers' step caches
        key on."""
        batch, dtype = text.video.shape[0], self.transformer.dtype
        video, audio = step.latents
        video_coords, audio_coords = step.coords
        with self.transformer.cache_context(branch):
            video_velocity, audio_velocity = self.transformer(
                hidden_states=torch.cat([video] * batch).to(dtype),
                audio_hidden_states=torch.cat([audio] * batch).to(dtype),
                encoder_hidden_states=text.video,
                audio_encoder_hidden_states=text.audio,
                timestep=step.video_timestep(batch),
                # The transformer's default (the video's timestep) for text-to-video, as the pipelines pass it.
                audio_timestep=step.timestep.expand(batch),
                sigma=step.timestep.expand(batch),
                encoder_attention_mask=text.mask,
                audio_encoder_attention_mask=text.mask,
                num_frames=step.grid.frames,
                height=step.grid.height,
                width=step.grid.width,
                fps=step.fps,
                audio_num_frames=step.grid.audio_frames,
                video_coords=video_coords.repeat(batch, *(1,) * (video_coords.ndim - 1)),
                audio_coords=audio_coords.repeat(batch, *(1,) * (audio_coords.ndim - 1)),
                isolate_modalities=isolate_modalities,
                spatio_temporal_guidance_blocks=stg_blocks,
                perturbation_mask=None,
                use_cross_timestep=self.guidance.use_cross_timestep,
                attention_kwargs=None,
                return_dict=False,
            )
        return video_velocity.float(), audio_velocity.float()

    def predictions(
        self,
        step: Step,
        prompt: LTX2Text,
        negative: LTX2Text | None,
        scales: tuple[ModalityScales, ModalityScales],
    ) -> Predictions:
        """One step's passes as x0: the positive prompt's (with the negative prompt's in one batch of two, negative
        first, where CFG runs, as the pipeline batches them), then the STG pass and the modality-isolated pass of the
        positive prompt where they run."""
        negative_x0 = None
        if negative is not None:
            video, audio = self._predict(step, LTX2Text.stacked([negative, prompt]), "cond_uncond")
            (video_uncond, video_cond), (audio_uncond, audio_cond) = video.chunk(2), audio.chunk(2)
            positive_x0, negative_x0 = step.x0((video_cond, audio_cond)), step.x0((video_uncond, audio_uncond))
        else:
            positive_x0 = step.x0(self._predict(step, prompt, "cond_uncond"))
        stg_x0 = None
        if runs_stg(*scales):
            stg_x0 = step.x0(self._predict(step, prompt, "uncond_stg", stg_blocks=list(self.guidance.stg_blocks)))
        isolated_x0 = None
        if runs_modality(*scales):
            isolated_x0 = step.x0(self._predict(step, prompt, "uncond_modality", isolate_modalities=True))
        return Predictions(positive_x0, negative_x0, stg_x0, isolated_x0)

    @torch.no_grad()
    def denoise_av(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs every step; returns (video latents [1, C, T, h, w], audio latents [1, Ca, A, M]), float32 and
        de-normalised, as LTX2Pipeline(output_type="latent") returns them; on_step(step, total) after each.

        `conditioning`: "prompt_video_embeds", "prompt_audio_embeds" (and "prompt_embeds_mask") and, when CFG runs
        (`LTX2Guidance.scales`: the video's or the audio's scale above 1), the same for "negative_prompt".
        `spec.fps` (0: LTX2Pipeline's default, 24) is the video's playback rate: it decides the sound's length and
        the video's positions in time, as LTX2Pipeline's `frame_rate` does. With "image_latents" (image-to-video)
        the first latent frame is the image's, as LTX2ImageToVideoPipeline(output_type="latent") returns it.
        """
        dtype = self.transformer.dtype
        video_scales, audio_scales = self.guidance.scales(spec.guidance_scale)
        prompt = LTX2Text.from_conditioning(conditioning, "prompt", self.device, dtype)
        negative = None
        if runs_cfg(video_scales, audio_scales):
            if "negative_prompt_video_embeds" not in conditioning:
                raise ValueError(
                    f"negative_prompt_video_embeds are required: CFG runs at video scale {video_scales.cfg:g} and "
                    f"audio scale {audio_scales.cfg:g}"
                )
            negative = LTX2Text.from_conditioning(conditioning, "negative_prompt", self.device, dtype)

        frame_rate = spec.fps or FPS
        grid = self.latent_grid(spec, frame_rate)
        video_start, audio_noise = self.initial_noise(spec, grid)
        mask = None
        image_latents = conditioning.get("image_latents")
        if image_latents is not None:
            video_start, mask = self.first_frame_conditioned(video_start, image_latents)
        video, audio = self.pack_video(video_start), self.pack_audio(audio_noise)
        steps = spec.num_inference_steps
        video_scheduler, audio_scheduler, timesteps = self.schedulers(steps, video.shape[1])
        fps = frame_rate / self.guidance.motion_speed
        coords = (
            self.transformer.rope.prepare_video_coords(1, grid.frames, grid.height, grid.width, self.device, fps=fps),
            self.transformer.audio_rope.prepare_audio_coords(1, grid.audio_frames, self.device),
        )

        for i, t in enumerate(timesteps):
            stop_if_cancelled(cancelled, self.parallel, self.device)
            sigmas = (video_scheduler.sigmas[i], audio_scheduler.sigmas[i])
            step = Step((video, audio), t, sigmas, grid, fps, coords, mask)
            predictions = self.predictions(step, prompt, negative, (video_scales, audio_scales))
            # Guided in x0 space, each modality with its own scales, then back to velocities for the schedulers.
            video_velocity = step.velocity(0, predictions.guided(0, video_scales))
            audio_velocity = step.velocity(1, predictions.guided(1, audio_scales))
            video = self.step_video(video_scheduler, video_velocity, t, video, grid, mask is not None)
            audio = audio_scheduler.step(audio_velocity, t, audio, return_dict=False)[0]
            on_step(i + 1, len(timesteps))

        return self.output_latents(video, audio, grid)

    def output_latents(
        self, video: torch.Tensor, audio: torch.Tensor, grid: LatentGrid
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed video [1, T*h*w, C] and audio [1, A, Ca*M] latents as LTX2Pipeline(output_type="latent") returns
        them: the video unpacked and de-normalised with the video VAE's latents_mean / latents_std and
        scaling_factor, the audio de-normalised with the audio VAE's statistics and unpacked, both float32."""
        video_latents = self.unpack_video(video, grid)
        stats = self.video_statistics
        mean = stats.mean.view(1, -1, 1, 1, 1).to(self.device, video_latents.dtype)
        std = stats.std.view(1, -1, 1, 1, 1).to(self.device, video_latents.dtype)
        video_latents = video_latents * std / self.scaling_factor + mean
        audio_stats = self.audio_statistics
        audio = audio * audio_stats.std.to(self.device, audio.dtype) + audio_stats.mean.to(self.device, audio.dtype)
        return video_latents.float(), self.unpack_audio(audio, grid).float()

    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """The Denoiser protocol's call: the video latents [1, C, T, h, w] of `denoise_av` at 24 frames per second,
        without the audio latents (the DiT stage runs `denoise_av` and sends both)."""
        return self.denoise_av(spec, conditioning, on_step, cancelled)[0]
