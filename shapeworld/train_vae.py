"""Training the demo model's video autoencoder, a tiny `AutoencoderKLWan`, on the shape world.

The model is diffusers' own class with the Wan2.1 layout (8x spatial, 4x temporal compression, causal in time);
only the training is ours (BENCHMARKS.md, "The demo model", records what these choices were measured on):

- **Causal chunks, as the model runs.** `encode` and `decode` walk the video as `AutoencoderKLWan._encode` /
  `_decode` do (the first frame alone, then chunks of four frames through the feature caches), keeping the
  autograd graph and without the output clamp (a clamped output has no gradient where it overshoots).
- **Images first, then videos.** The model starts as a per-frame autoencoder (earlier time taps zero); the image
  phase trains that and the video phase learns the time taps. Each phase has its own warm-up and cosine decay,
  because one decay over both keeps the image phase near the peak, where it stalls.
- **Loss**: L1 + L2 on pixels, object pixels weighted up (`foreground_weight`: what the quality check reads),
  plus a small KL term on the posterior.
- **Biases start at zero** (but the output's) and the learning rate is low (3e-4): RMS norms that do not
  subtract a mean shrink what random biases leave of the colour, and a higher rate drifts into one colour.
- **`fast_rms_norm`** computes `WanRMS_norm.forward`'s function with a sum of squares, faster on the CPU than
  `F.normalize`; the saved model runs the library's own code.
- Random 32x32 crops of 5-frame 64x64 clips, with whole 17-frame clips every few steps so that the mid-block
  attention and every chunk's caches train on the full extent and place; bf16 autocast where the CPU has it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders import autoencoder_kl_wan

from shapeworld.world import Concept, render, sample_scene

LATENT_FRAMES_PER_CHUNK = 4


@dataclass(frozen=True)
class VaeSchedule:
    image_steps: int = 1000  # steps on single frames
    video_steps: int = 1000  # then steps on clips
    image_batch: int = 16
    video_batch: int = 12
    whole_batch: int = 2  # every `whole_every`-th step trains on whole frames instead of crops
    whole_every: int = 4
    frames: int = 5  # per cropped clip: the first frame and one causal chunk
    whole_frames: int = 17  # per whole clip: as long as the videos served, so every chunk's cache is trained
    size: int = 64
    crop: int = 32
    learning_rate: float = 3e-4  # peak of the image phase
    video_learning_rate: float = 1.5e-4  # peak of the video phase
    warmup_steps: int = 30  # of each phase
    foreground_weight: float = 8.0
    kl_weight: float = 1e-4
    grad_clip: float = 1.0

    @property
    def steps(self) -> int:
        return self.image_steps + self.video_steps


def prepare_for_training(vae: AutoencoderKLWan) -> None:
    """Initialises `vae` as a per-frame autoencoder with zero biases (see the module doc); all of it trains."""
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, autoencoder_kl_wan.WanResample) and hasattr(module, "time_conv"):
                conv = module.time_conv
                conv.weight.zero_()
                channels = conv.in_channels
                eye = torch.arange(channels)
                if module.mode == "downsample3d":  # mean of the frames the stride-2 kernel covers
                    conv.weight[eye, eye, :, 0, 0] = 1.0 / conv.kernel_size[0]
                else:  # upsample3d: both output frames copy the current one
                    conv.weight[eye, eye, -1, 0, 0] = 1.0
                    conv.weight[eye + channels, eye, -1, 0, 0] = 1.0
            elif isinstance(module, autoencoder_kl_wan.WanCausalConv3d) and module.kernel_size[0] > 1:
                module.weight[:, :, :-1].zero_()
        # The posterior starts nearly deterministic (log-variance -8), so early training is not drowned in noise.
        vae.quant_conv.bias[vae.config.z_dim :] = -8.0
        for name, parameter in vae.named_parameters():
            if name.endswith(".bias") and name not in ("decoder.conv_out.bias", "quant_conv.bias"):
                parameter.zero_()


def encode(vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    """[B, 2 z_dim, T', h, w] posterior moments of [B, 3, T, H, W] in [-1, 1], chunk by chunk as `_encode`."""
    vae.clear_cache()
    chunks = []
    for index in range(1 + (video.shape[2] - 1) // LATENT_FRAMES_PER_CHUNK):
        vae._enc_conv_idx = [0]
        start = 0 if index == 0 else 1 + LATENT_FRAMES_PER_CHUNK * (index - 1)
        stop = 1 if index == 0 else start + LATENT_FRAMES_PER_CHUNK
        chunks.append(vae.encoder(video[:, :, start:stop], feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx))
    moments = vae.quant_conv(torch.cat(chunks, dim=2))
    vae.clear_cache()
    return moments


def decode(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] (unclamped) of latents [B, z_dim, T', h, w], latent frame by latent frame as `_decode`."""
    vae.clear_cache()
    hidden = vae.post_quant_conv(latents)
    frames = []
    for index in range(hidden.shape[2]):
        vae._conv_idx = [0]
        frames.append(
            vae.decoder(
                hidden[:, :, index : index + 1],
                feat_cache=vae._feat_map,
                feat_idx=vae._conv_idx,
                first_chunk=index == 0,
            )
        )
    vae.clear_cache()
    return torch.cat(frames, dim=2)


@contextlib.contextmanager
def fast_rms_norm() -> Iterator[None]:
    """Swaps in an equal, faster `WanRMS_norm.forward` for training (float32 or autocast inputs only)."""

    def forward(self: autoencoder_kl_wan.WanRMS_norm, x: torch.Tensor) -> torch.Tensor:
        dim = 1 if self.channel_first else -1
        squares = x.float().pow(2).sum(dim, keepdim=True)
        normalized = (x.float() * torch.rsqrt(squares.clamp_min(1e-24))).to(x.dtype)
        return normalized * self.scale * self.gamma + self.bias

    original = autoencoder_kl_wan.WanRMS_norm.forward
    autoencoder_kl_wan.WanRMS_norm.forward = forward
    try:
        yield
    finally:
        autoencoder_kl_wan.WanRMS_norm.forward = original


def to_model_range(frames: np.ndarray) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] -> float32 [B, 3, T, H, W] in [-1, 1]."""
    return torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(0, 4, 1, 2, 3).contiguous()


def clip_batch(
    concepts: list[Concept], rng: np.random.Generator, count: int, frames: int, size: int, crop: int
) -> torch.Tensor:
    """`count` random scenes, each cropped to `crop` x `crop` (at a multiple of 8) around its object."""
    clips = []
    for _ in range(count):
        scene = sample_scene(concepts[rng.integers(len(concepts))], rng)
        video = render(scene, frames, size, size)
        if crop < size:
            # Centre the crop on the object's mean position, give or take a latent pixel.
            centre = ((scene.start[0] + scene.end[0]) / 2 * size, (scene.start[1] + scene.end[1]) / 2 * size)
            x, y = (int(np.clip(8 * (round((c - crop / 2) / 8) + rng.integers(-1, 2)), 0, size - crop)) for c in centre)
            video = video[:, y : y + crop, x : x + crop]
        clips.append(video)
    return to_model_range(np.stack(clips))


def train_vae(
    vae: AutoencoderKLWan,
    concepts: list[Concept],
    schedule: VaeSchedule,
    seed: int,
    on_step: Callable[[int, dict[str, float]], None],
) -> dict[str, float]:
    """Trains `vae` in place on scenes of `concepts`; on_step(step, losses) after each step. Returns the losses
    of the last 50 steps (means)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    prepare_for_training(vae)
    parameters = list(vae.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=schedule.learning_rate, weight_decay=0.0)
    autocast = bf16_autocast_available()
    recent: list[dict[str, float]] = []
    vae.train()
    with fast_rms_norm():
        for step in range(schedule.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(schedule, step)
            video = _batch_for(step, concepts, rng, schedule)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                moments = encode(vae, video)
            mean, log_variance = moments.float().chunk(2, dim=1)
            log_variance = log_variance.clamp(-30.0, 20.0)
            latents = mean + torch.randn_like(mean) * torch.exp(0.5 * log_variance)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                reconstruction = decode(vae, latents)
            losses = _losses(video, reconstruction.float(), mean, log_variance, schedule)
            optimizer.zero_grad(set_to_none=True)
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(parameters, schedule.grad_clip)
            optimizer.step()
            values = {name: float(value.detach()) for name, value in losses.items()}
            recent = [*recent[-49:], values]
            on_step(step, values)
    vae.eval()
    return {name: round(sum(r[name] for r in recent) / len(recent), 5) for name in recent[-1]}


def learning_rate(schedule: VaeSchedule, step: int) -> float:
    """Each phase its own linear warm-up, then a cosine decay to zero over that phase's steps."""
    if step < schedule.image_steps:
        peak, step, steps = schedule.learning_rate, step, schedule.image_steps
    else:
        peak, step, steps = schedule.video_learning_rate, step - schedule.image_steps, schedule.video_steps
    warmup = min(1.0, (step + 1) / schedule.warmup_steps)
    return peak * warmup * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def bf16_autocast_available() -> bool:
    """Whether this CPU has native bf16 matrix instructions (AMX or AVX512-BF16), which make autocast pay."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def _batch_for(step: int, concepts: list[Concept], rng: np.random.Generator, schedule: VaeSchedule) -> torch.Tensor:
    whole = step % schedule.whole_every == schedule.whole_every - 1
    if step < schedule.image_steps:
        if whole:  # a quarter as many whole frames cost about what the crops do
            return clip_batch(concepts, rng, max(1, schedule.image_batch // 4), 1, schedule.size, schedule.size)
        return clip_batch(concepts, rng, schedule.image_batch, 1, schedule.size, schedule.crop)
    if whole:
        return clip_batch(concepts, rng, schedule.whole_batch, schedule.whole_frames, schedule.size, schedule.size)
    return clip_batch(concepts, rng, schedule.video_batch, schedule.frames, schedule.size, schedule.crop)


def _losses(
    video: torch.Tensor,
    reconstruction: torch.Tensor,
    mean: torch.Tensor,
    log_variance: torch.Tensor,
    schedule: VaeSchedule,
) -> dict[str, torch.Tensor]:
    error = reconstruction - video
    chroma = video.amax(dim=1, keepdim=True) - video.amin(dim=1, keepdim=True)
    foreground = F.max_pool3d((chroma > 0.25).float(), (1, 3, 3), stride=1, padding=(0, 1, 1))
    weight = 1.0 + schedule.foreground_weight * foreground
    reconstruction_loss = ((error.abs() + error.pow(2)) * weight).mean() / weight.mean()
    kl = 0.5 * (mean.pow(2) + log_variance.exp() - 1.0 - log_variance).mean()
    return {
        "loss": reconstruction_loss + schedule.kl_weight * kl,
        "l1": error.abs().mean().detach(),
        "l1_object": (error.abs().mean(dim=1, keepdim=True) * (chroma > 0.25)).sum().detach()
        / (chroma > 0.25).sum().clamp_min(1),
        "kl": kl.detach(),
    }


def reconstruct(vae: AutoencoderKLWan, frames: np.ndarray) -> np.ndarray:
    """uint8 [T, H, W, 3] through the autoencoder (posterior mean), as the library's encode and decode run."""
    with torch.no_grad():
        video = to_model_range(frames[None])
        decoded = vae.decode(vae.encode(video).latent_dist.mode()).sample
    return ((decoded[0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
