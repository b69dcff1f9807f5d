"""Streaming HunyuanVideo 1.5 VAE decode: one latent frame in, its video frames out.

AutoencoderKLHunyuanVideo15's decoder is causal in time: latent frame 0 decodes to 1 video frame and every later
latent frame to 4, from that frame and earlier ones only. diffusers decodes the whole latent video in one call and
keeps no cache between calls, so this module adds one: a `HunyuanVideo15DecodeSession` holds one request's
`StreamCache` and decodes each latent frame as it arrives from the DiT, so the first frames leave the stage while
later ones are still being denoised. The arithmetic is the library's own (its modules' convs, norms and
rearrangements, in the same order), so the frames equal HunyuanVideo15Pipeline's up to float rounding: the
latents divided by the config's `scaling_factor`, decoded, clamped to [-1, 1] and mapped to [0, 1] (its video
processor maps x to x / 2 + 0.5 and clamps to [0, 1], so clamping first keeps the same frames).

The rules of the stream, module by module:

- `HunyuanVideo15CausalConv3d` pads time on the left with `kernel_t - 1` frames. On a session's first call that is
  the library's padding (replicate: copies of the first frame); on later calls it is the last `kernel_t - 1` frames
  of that conv's time-padded input in the previous call, which the cache keeps. Height and width are padded as the
  library does, after.
- `HunyuanVideo15AttnBlock` (the mid block) attends causally over frames: the queries of the current frames see
  the keys and values of every earlier frame of the session, which the cache keeps, and of the current frames up
  to their own.
- `HunyuanVideo15Upsample` with temporal upsampling makes 1 frame of frame 0 and 2 of each later frame: the
  first-frame rule applies on a session's first call only.

The library modules have no cache API, so `install_stream_forwards` puts stream forwards on the decoder's modules
once (the decoder does it when it loads the VAE). They act only while a session's cache is active in the calling
thread or task (a ContextVar the session sets around its call) and call the library's forward otherwise: sessions
on one VAE in different threads never mix, and a plain `vae.decode` is untouched.

Memory: a causal conv's cache is `kernel_t - 1` (2) frames of its input, bounded. The attention cache grows by one
latent frame's keys and values per latent frame (2 x 1024 channels x h x w for the released VAE: about 29 MB in
float32 per latent frame of a 720p video, 1 GB for 33 latent frames) and lives as long as the session.

Patch-parallel decode (vae_svc/band_hunyuanvideo15.py) runs this session on each rank's band of rows: its band
forwards take the place of the conv and attention stream forwards and use `causal_frames` and
`cached_keys_values` below for the time side, so band and stream cache both apply.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLHunyuanVideo15
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
    HunyuanVideo15AttnBlock,
    HunyuanVideo15CausalConv3d,
    HunyuanVideo15Upsample,
)
from torch import nn

from stagekit.decode import LatentDecoder, to_uint8_frames
from stagekit.weights import load_pretrained

_ACTIVE_STREAM: contextvars.ContextVar[StreamCache | None] = contextvars.ContextVar(
    "hunyuanvideo15_stream", default=None
)


class StreamCache:
    """What one session carries from one call of the decoder to the next, keyed by the decoder's modules."""

    def __init__(self) -> None:
        self.first_call = True
        # Per causal conv: the last kernel_t - 1 frames of its time-padded input.
        self.conv_frames: dict[nn.Module, torch.Tensor] = {}
        # Per attention block: the keys and values of every frame so far, [B, C, frames, h, w].
        self.keys: dict[nn.Module, torch.Tensor] = {}
        self.values: dict[nn.Module, torch.Tensor] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Makes the stream forwards use this cache in the calling thread or task for the duration."""
        token = _ACTIVE_STREAM.set(self)
        try:
            yield
        finally:
            _ACTIVE_STREAM.reset(token)


# --- the time side, shared with the patch-parallel band forwards ------------------------------------


def causal_frames(conv: HunyuanVideo15CausalConv3d, x: torch.Tensor) -> torch.Tensor:
    """x [B, C, T, h, w] with the `kernel_t - 1` frames before it prepended (height and width not padded).

    Outside a session and on a session's first call they are the library's time padding (copies of the first
    frame); on later calls, the last frames of this conv's time-padded input in the previous call. Within a
    session the last frames of the result are kept for the next call.
    """
    context = conv.time_causal_padding[4]
    stream = _ACTIVE_STREAM.get()
    if stream is None or stream.first_call:
        x = F.pad(x, (0, 0, 0, 0, context, 0), mode=conv.pad_mode)
    else:
        x = torch.cat([stream.conv_frames[conv], x], dim=2)
    if stream is not None:
        stream.conv_frames[conv] = x[:, :, x.shape[2] - context :].clone()
    return x


def cached_keys_values(
    block: HunyuanVideo15AttnBlock, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The keys and values [B, C, frames, h, w] of every frame of the session, the current frames' last, and the
    number of earlier frames; within a session they are kept for the next call."""
    stream = _ACTIVE_STREAM.get()
    if stream is None:
        return key, value, 0
    earlier = 0
    if not stream.first_call:
        earlier = stream.keys[block].shape[2]
        key = torch.cat([stream.keys[block], key], dim=2)
        value = torch.cat([stream.values[block], value], dim=2)
    stream.keys[block] = key
    stream.values[block] = value
    return key, value, earlier


def frame_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, earlier_frames: int
) -> torch.Tensor:
    """The attention of HunyuanVideo15AttnBlock: one head over all channels, each query frame seeing the keys of
    the frames up to its own.

    query [B, C, F, h, w] holds the current frames (or a band of their rows), key and value [B, C, earlier + F, H, W]
    the earlier frames then the current ones. Returns [B, C, F, h, w]. With one current frame every key is
    visible and no mask is built (the library's mask would be all zeros).
    """
    batch, channels, frames, height, width = query.shape

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, C, F, h, w] -> [B, 1, F*h*w, C], as the library orders them
        return t.reshape(batch, channels, -1).permute(0, 2, 1).unsqueeze(1).contiguous()

    mask = None
    if frames > 1:
        device = query.device
        query_frame = torch.arange(frames, device=device).repeat_interleave(height * width) + earlier_frames
        key_frame = torch.arange(key.shape[2], device=device).repeat_interleave(key.shape[3] * key.shape[4])
        hidden = key_frame.unsqueeze(0) > query_frame.unsqueeze(1)
        mask = torch.zeros(hidden.shape, dtype=query.dtype, device=device).masked_fill(hidden, float("-inf"))
    x = F.scaled_dot_product_attention(tokens(query), tokens(key), tokens(value), attn_mask=mask)
    return x.squeeze(1).reshape(batch, frames, height, width, channels).permute(0, 4, 1, 2, 3)


# --- the stream forwards ----------------------------------------------------------------------------


def stream_conv_forward(self: HunyuanVideo15CausalConv3d, x: torch.Tensor) -> torch.Tensor:
    """The causal conv's forward with the session's earlier frames as its time padding."""
    if _ACTIVE_STREAM.get() is None:
        return HunyuanVideo15CausalConv3d.forward(self, x)
    x = causal_frames(self, x)
    x = F.pad(x, (*self.time_causal_padding[:4], 0, 0), mode=self.pad_mode)
    return self.conv(x)


def stream_attention_forward(self: HunyuanVideo15AttnBlock, x: torch.Tensor) -> torch.Tensor:
    """The attention block's forward with the session's earlier keys and values."""
    if _ACTIVE_STREAM.get() is None:
        return HunyuanVideo15AttnBlock.forward(self, x)
    identity = x
    x = self.norm(x)
    query = self.to_q(x)
    key, value, earlier = cached_keys_values(self, self.to_k(x), self.to_v(x))
    x = frame_causal_attention(query, key, value, earlier)
    return self.proj_out(x) + identity


def stream_upsample_forward(self: HunyuanVideo15Upsample, x: torch.Tensor) -> torch.Tensor:
    """The upsampler's forward, its first-frame rule on a session's first call only."""
    stream = _ACTIVE_STREAM.get()
    if stream is None or stream.first_call or not self.add_temporal_upsample:
        return HunyuanVideo15Upsample.forward(self, x)
    # Every frame is a later frame: 2 in time (the library's h_next and x_next).
    h = self._dcae_upsample_rearrange(self.conv(x), r1=2, r2=2, r3=2)
    shortcut = self._dcae_upsample_rearrange(x, r1=2, r2=2, r3=2)
    shortcut = shortcut.repeat_interleave(repeats=self.repeats, dim=1)
    return h + shortcut


STREAM_FORWARDS: tuple[tuple[type[nn.Module], Callable[..., Any]], ...] = (
    (HunyuanVideo15CausalConv3d, stream_conv_forward),
    (HunyuanVideo15AttnBlock, stream_attention_forward),
    (HunyuanVideo15Upsample, stream_upsample_forward),
)


def install_stream_forwards(decoder: nn.Module) -> int:
    """Installs the stream forwards on `decoder`'s (a `vae.decoder`'s) causal convs, attention blocks and
    upsamplers (idempotent); returns how many modules have one.

    RuntimeError if a module's forward was already replaced by something else (an offload hook, or
    patch-parallel band forwards installed first), which the stream forward would silently bypass.
    """
    count = 0
    for module in decoder.modules():
        forward = next((f for cls, f in STREAM_FORWARDS if isinstance(module, cls)), None)
        if forward is None:
            continue
        installed = module.__dict__.get("forward")
        if installed is None:
            module.forward = types.MethodType(forward, module)
        elif getattr(installed, "__func__", installed) is not forward:
            raise RuntimeError(f"{type(module).__name__} already has a replaced forward ({installed!r})")
        count += 1
    return count


# --- the decoder and its sessions -------------------------------------------------------------------


class HunyuanVideo15StreamingDecoder(LatentDecoder):
    vae_class = AutoencoderKLHunyuanVideo15

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        # The VAE normalises with one scaling factor, not per-channel statistics.
        self.device = device
        self.vae = load_pretrained(
            self.vae_class, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.latent_channels
        self.scaling_factor = config.scaling_factor
        install_stream_forwards(self.vae.decoder)

    def session(self) -> HunyuanVideo15DecodeSession:
        return HunyuanVideo15DecodeSession(self)


class HunyuanVideo15DecodeSession:
    """One request's decode: the stream cache of its decoder's convs and attention."""

    def __init__(self, decoder: HunyuanVideo15StreamingDecoder) -> None:
        self.decoder = decoder
        self.cache = StreamCache()
        self.frames_decoded = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes the next latent frame [1, C, 1, h, w] (or several consecutive ones) to the decoder output
        [1, 3, n, H, W] clamped to [-1, 1]: n is 1 for the first latent frame, 4 for each later one."""
        owner = self.decoder
        vae = owner.vae
        latents = latent_frame.to(owner.device, vae.dtype) / owner.scaling_factor
        with self.cache.active():
            video = vae.decoder(latents)
        self.cache.first_call = False
        self.frames_decoded += video.shape[2]
        return video.clamp(-1.0, 1.0)

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes the next latent frame [1, C, 1, h, w] to uint8 frames [n, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
