"""Band forwards of the HunyuanVideo 1.5 VAE decoder (HunyuanVideo15Decoder3D), streamed.

The decoder is a causal conv_in (plus a shortcut that repeats each pixel's channels), a mid block of resnets
around a causal attention block, up blocks of resnets and upsamplers, an RMS norm, SiLU and a causal conv_out.
Its causal convs pad height and width with replicate padding, not zeros. Split by rows (vae_svc/row_bands.py
has the band layout):

- Every causal conv with a kernel taller than 1 first takes its time context (families/hunyuanvideo_15/decode.py's
  `causal_frames`: the stream's cached frames, or the library's padding on a session's first call), then receives
  from its neighbours the `kernel // 2` halo rows above and below its band, for every frame of that context. At
  the true image edges the halo is the library's own padding (the edge row repeated), then width is padded as the
  library does. The stream cache holds band rows only, without halo, so each conv sees exactly the rows of the
  whole-frame decode.
- `HunyuanVideo15AttnBlock` computes queries for its own rows and all-gathers the whole frame's keys and values
  of the current frames; the stream cache keeps those whole-frame keys and values (decode.py's
  `cached_keys_values`), so every query attends to all rows of all earlier and current frames. Each rank thus
  holds the whole attention cache, as a single device would (it is at latent resolution).
- Everything else is row-local: the RMS norms normalise each pixel over its channels, SiLU is pointwise, 1x1x1
  convs mix channels, the upsampler's `_dcae_upsample_rearrange` is a pixel shuffle that turns each row into 2 rows
  (and each frame into 1 or 2), its shortcut and conv_in's `repeat_interleave` shortcut repeat channels.

The conv and attention band forwards take the place of the stream forwards the decoder installed on those modules
(`BandModules.replaces`) and call them while no bands are active, so single-device sessions on the same model
stream as before and patch-parallel sessions run the family's streaming session on their band.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
    HunyuanVideo15AttnBlock,
    HunyuanVideo15CausalConv3d,
    HunyuanVideo15RMS_norm,
)
from torch import nn

from families.hunyuanvideo_15.decode import (
    cached_keys_values,
    causal_frames,
    frame_causal_attention,
    stream_attention_forward,
    stream_conv_forward,
)
from vae_svc.row_bands import BandModules, active_bands, band_forward, convolve, exchange_halos, gather_rows


@band_forward
def causal_conv_forward(self: HunyuanVideo15CausalConv3d, x: torch.Tensor) -> torch.Tensor:
    """The causal conv's stream forward with the height padding inside the image replaced by neighbour rows."""
    bands = active_bands()
    if bands is None:
        return stream_conv_forward(self, x)
    width, _, halo, _, _, _ = self.time_causal_padding
    x = causal_frames(self, x)
    above, below = exchange_halos(x, halo, bands)
    # The library's padding holds at the image's top and bottom edges; inside it, the neighbours' rows.
    padded = F.pad(x, (0, 0, halo, halo, 0, 0), mode=self.pad_mode)
    if above is not None:
        padded[..., :halo, :] = above
    if below is not None:
        padded[..., padded.shape[-2] - halo :, :] = below
    padded = F.pad(padded, (width, width, 0, 0, 0, 0), mode=self.pad_mode)
    return convolve(self.conv, padded)


@band_forward
def attention_forward(self: HunyuanVideo15AttnBlock, x: torch.Tensor) -> torch.Tensor:
    """The attention block's stream forward with local query rows against the whole frames' keys and values."""
    bands = active_bands()
    if bands is None:
        return stream_attention_forward(self, x)
    identity = x
    x = self.norm(x)
    query = self.to_q(x)
    key = gather_rows(self.to_k(x), bands)
    value = gather_rows(self.to_v(x), bands)
    key, value, earlier = cached_keys_values(self, key, value)
    x = frame_causal_attention(query, key, value, earlier)
    return self.proj_out(x) + identity


def _plan_attention(name: str, module: HunyuanVideo15AttnBlock) -> Callable[..., Any]:
    return attention_forward


def _plan_causal_conv(name: str, module: HunyuanVideo15CausalConv3d) -> Callable[..., Any] | None:
    """Height stride and dilation 1, 'same' height padding: halo rows for kernels taller than 1; a kernel 1 row
    tall leaves the conv row-local (its inner conv is then checked on its own)."""
    conv = module.conv
    if conv.stride[1] != 1 or conv.dilation[1] != 1 or conv.padding[1] != 0:
        raise NotImplementedError(
            f"patch-parallel decode needs height stride and dilation 1, no inner padding ({name})"
        )
    if conv.kernel_size[1] == 1:
        return None
    if module.time_causal_padding[2:4] != (conv.kernel_size[1] // 2,) * 2:
        raise NotImplementedError(f"patch-parallel decode needs 'same' height padding ({name})")
    return causal_conv_forward


def _plan_conv3d(name: str, module: nn.Conv3d) -> None:
    """A plain Conv3d (the 1x1x1 convs of the resnets and the attention) is row-local if it is 1 row tall."""
    if module.kernel_size[1] != 1 or module.stride[1] != 1 or module.padding[1] != 0:
        raise NotImplementedError(f"patch-parallel decode needs Conv3d kernels 1 row tall ({name})")


HUNYUANVIDEO15_BAND_MODULES = BandModules(
    planners=(
        (HunyuanVideo15AttnBlock, _plan_attention),
        (HunyuanVideo15CausalConv3d, _plan_causal_conv),
        (nn.Conv3d, _plan_conv3d),
    ),
    row_local=(nn.SiLU, HunyuanVideo15RMS_norm),
    replaces=(stream_conv_forward, stream_attention_forward),
)
