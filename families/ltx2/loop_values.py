"""The values LTX-2's denoising loop (families/ltx2/denoise.py) passes around: one text's conditioning, a request's
latent sizes, a VAE's latent statistics, and what every pass of one step shares (with the pipeline's conversions
between velocities and x0). Plain data and the arithmetic on it; no transformer here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from families.ltx2.guidance import VideoAudio
from stagekit.weights.keys import weight_files


@dataclass(frozen=True)
class LTX2Text:
    """One text's conditioning: the connectors' video [1, L, dim] and audio [1, L, audio dim] embeddings and the
    mask [1, L] both streams attend with."""

    video: torch.Tensor
    audio: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def from_conditioning(
        cls, conditioning: dict[str, torch.Tensor], role: str, device: torch.device, dtype: torch.dtype
    ) -> LTX2Text:
        """The text `role` ("prompt" or "negative_prompt") as the DiT stage received it, on `device`."""
        video = conditioning[f"{role}_video_embeds"]
        mask = conditioning.get(f"{role}_embeds_mask")
        if mask is None:
            mask = torch.ones(video.shape[:2], dtype=torch.long)
        audio = conditioning[f"{role}_audio_embeds"]
        return cls(video.to(device, dtype), audio.to(device, dtype), mask.to(device))

    @classmethod
    def stacked(cls, texts: list[LTX2Text]) -> LTX2Text:
        """The texts as one batch, in order."""
        return cls(
            torch.cat([text.video for text in texts]),
            torch.cat([text.audio for text in texts]),
            torch.cat([text.mask for text in texts]),
        )


@dataclass(frozen=True)
class LatentGrid:
    """The latent sizes of a request: video frames, height and width, audio frames and latent mel bins."""

    frames: int
    height: int
    width: int
    audio_frames: int
    mel_bins: int


@dataclass(frozen=True)
class Statistics:
    """A VAE's per-channel latents_mean and latents_std (buffers saved with its weights), float32."""

    mean: torch.Tensor
    std: torch.Tensor

    @classmethod
    def read(cls, folder: Path) -> Statistics:
        """The statistics in a VAE folder's safetensors (one file or the shards its index lists)."""
        found: dict[str, torch.Tensor] = {}
        for path in weight_files(folder):
            with safe_open(path, "pt") as weights:
                names = set(weights.keys())
                for name in ("latents_mean", "latents_std"):
                    if name in names:
                        found[name] = weights.get_tensor(name).float()
        missing = {"latents_mean", "latents_std"} - set(found)
        if missing:
            raise ValueError(f"{folder}: the VAE's weights hold no {', '.join(sorted(missing))}")
        return cls(found["latents_mean"], found["latents_std"])


@dataclass(frozen=True)
class Step:
    """What every pass of one step shares: the packed float32 latents, the scheduler's timestep and each modality's
    sigma, the latent sizes, the positions' frame rate, the positions (of a batch of one) and, for image-to-video,
    the packed conditioning mask [1, tokens] (1 at the first frame's tokens, which are kept clean)."""

    latents: VideoAudio
    timestep: torch.Tensor
    sigmas: tuple[torch.Tensor, torch.Tensor]
    grid: LatentGrid
    fps: float
    coords: tuple[torch.Tensor, torch.Tensor]
    conditioning_mask: torch.Tensor | None = None

    def video_timestep(self, batch: int) -> torch.Tensor:
        """The video's timestep for a batch: [batch], or per token [batch, tokens] with the conditioned tokens at 0
        (the image-to-video pipeline's `timestep.unsqueeze(-1) * (1 - conditioning_mask)`)."""
        timestep = self.timestep.expand(batch)
        if self.conditioning_mask is None:
            return timestep
        return timestep.unsqueeze(-1) * (1 - self.conditioning_mask.expand(batch, -1))

    def x0(self, velocities: VideoAudio) -> VideoAudio:
        """The pipeline's convert_velocity_to_x0 of both modalities: latents - velocity * sigma."""
        return (
            self.latents[0] - velocities[0] * self.sigmas[0],
            self.latents[1] - velocities[1] * self.sigmas[1],
        )

    def velocity(self, modality: int, x0: torch.Tensor) -> torch.Tensor:
        """The pipeline's convert_x0_to_velocity of one modality (0 video, 1 audio): (latents - x0) / sigma."""
        return (self.latents[modality] - x0) / self.sigmas[modality]
