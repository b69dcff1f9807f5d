"""What every family's VAE decode shares: loading the VAE with its latent normalisation, undoing that
normalisation, and turning decoded pixels into uint8 frames.

A family's decoder (families/<family>/decode.py) subclasses `LatentDecoder` with its VAE class and a
`session()`: one request's decode, `decode_next(latent_frame [1, C, 1, h, w]) -> uint8 frames [n, H, W, 3]`,
called once per latent frame as the frames arrive from the DiT, and `decode_next_float`, the same decode
before the uint8 conversion (clamped to [-1, 1], [1, 3, n, H, W]), which patch-parallel decode runs on each
rank's band of latent rows (vae_svc/patch_parallel.py).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Protocol, TypeGuard, runtime_checkable

import numpy as np
import torch

from stagekit.weights import load_pretrained


class DecodeSession(Protocol):
    frames_decoded: int

    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor: ...

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor: ...


class LatentDecoder(ABC):
    """A family's VAE, its weights read with the stage's --num-weight-load-threads."""

    vae_class: ClassVar[type[torch.nn.Module]]
    # The checkpoint's components it loads, which the VAE stage's memory guard counts (LTX-2's adds its audio VAE
    # and vocoder).
    components: ClassVar[tuple[str, ...]] = ("vae",)

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        self.device = device
        self.vae = load_pretrained(
            self.vae_class, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.z_dim
        self.latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        # The pipelines divide by 1/std rather than multiplying by std; do the same for identical rounding.
        self.latents_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)

    @abstractmethod
    def session(self) -> DecodeSession:
        """One request's decode."""


@runtime_checkable
class AudioDecoder(Protocol):
    """The VAE stage's decoder of a family that makes sound with its video (LTX-2: an audio VAE and a vocoder beside
    the video VAE): the DiT's audio latents [1, Ca, A, M] to a waveform."""

    # Ca and M of the audio latents it takes, and audio latent frames per second of sound.
    audio_latent_channels: int
    audio_latent_mel_bins: int
    audio_latents_per_second: float

    def decode_audio(self, audio_latents: torch.Tensor) -> tuple[np.ndarray, int]:
        """Audio latents [1, Ca, A, M] -> (waveform float32 [channels, samples], sample rate)."""
        ...


def decodes_audio(decoder: object) -> TypeGuard[AudioDecoder]:
    """Whether `decoder` is an AudioDecoder (its family makes sound)."""
    return isinstance(decoder, AudioDecoder)


def session_takes_frame_count(decoder: object) -> bool:
    """Whether the decoder's `session` takes `num_latent_frames` (a decoder that needs to know which latent frame
    is the last: LTX-2's decodes the whole video there)."""
    session = getattr(decoder, "session", None)
    return callable(session) and "num_latent_frames" in inspect.signature(session).parameters


def denormalize_latents(latents: torch.Tensor, latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """Undoes the VAE's latent normalisation as the diffusers pipelines do (`latents_std` holds 1/std)."""
    mean = latents_mean.to(latents.device, latents.dtype)
    std = latents_std.to(latents.device, latents.dtype)
    return latents / std + mean


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[1, 3, n, H, W] in [-1, 1] -> uint8 [n, H, W, 3], as VideoProcessor.postprocess_video then x*255 rounded."""
    video = (video.float() / 2 + 0.5).clamp(0, 1)
    return (video[0].permute(1, 2, 3, 0) * 255).round().to(torch.uint8).cpu()
