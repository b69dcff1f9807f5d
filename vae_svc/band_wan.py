"""Band forwards of the Wan and Qwen-Image VAE decoders (WanDecoder3d, QwenImageDecoder3d).

AutoencoderKLQwenImage is the Wan2.1 VAE under other class names, so one set of band forwards serves both;
the Wan names below stand for either. The rules (vae_svc/row_bands.py has the band layout):

- Every spatial convolution first receives from its neighbours the `kernel // 2` halo rows above and below its
  band (zeros only at the true image edges), then runs without height padding; width and causal time padding are
  unchanged. The causal feature cache holds band inputs without halo and the halo exchange runs after the cached
  frames are concatenated in time, so each conv sees exactly the rows of the full-frame decode.
- `WanAttentionBlock` computes queries for its own rows and all-gathers the whole frame's keys and values.
- Everything else in the decoder is row-local: the RMS norms normalise each pixel over its channels, activations
  are pointwise, 1x1 convs mix channels, nearest upsampling by a whole factor (and Wan2.2's `DupUp3D`) repeats
  each row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import (
    QwenImageAttentionBlock,
    QwenImageCausalConv3d,
    QwenImageRMS_norm,
)
from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D, WanAttentionBlock, WanCausalConv3d, WanRMS_norm
from torch import nn

from vae_svc.row_bands import (
    BandModules,
    active_bands,
    band_forward,
    convolve,
    exchange_halos,
    gather_rows,
    place_halos,
    plan_conv2d,
)


@band_forward
def causal_conv3d_forward(self: nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """The causal conv's forward (WanCausalConv3d, QwenImageCausalConv3d) with the height padding replaced
    by neighbour rows (zeros at the image edges)."""
    bands = active_bands()
    if bands is None:
        return type(self).forward(self, x, cache_x)
    width, _, halo, _, time_front, _ = self._padding
    if cache_x is not None and time_front > 0:
        # As the library does: prepend the cached frames (band rows only), pad the rest of the time window.
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        time_front -= cache_x.shape[2]
    above, below = exchange_halos(x, halo, bands)
    padded = F.pad(x, (width, width, halo, halo, time_front, 0))
    place_halos(padded, above, below, halo, time_front, width)
    return convolve(self, padded)


@band_forward
def attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention block's forward (WanAttentionBlock, QwenImageAttentionBlock: the same arithmetic) with
    local query rows against the whole frame's keys and values."""
    bands = active_bands()
    if bands is None:
        return type(self).forward(self, x)
    identity = x
    batch_size, channels, time, height, width = x.size()
    x = x.permute(0, 2, 1, 3, 4).reshape(batch_size * time, channels, height, width)
    x = self.norm(x)
    q, k, v = self.to_qkv(x).chunk(3, dim=1)
    k = gather_rows(k, bands)
    v = gather_rows(v, bands)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [b*t, c, h, w] -> [b*t, 1, h*w, c], one head
        return t.flatten(2).transpose(1, 2).unsqueeze(1)

    x = F.scaled_dot_product_attention(tokens(q), tokens(k), tokens(v))
    x = x.squeeze(1).permute(0, 2, 1).reshape(batch_size * time, channels, height, width)
    x = self.proj(x)
    x = x.view(batch_size, time, channels, height, width).permute(0, 2, 1, 3, 4)
    return x + identity


def _plan_attention(name: str, module: nn.Module) -> Callable[..., Any]:
    return attention_forward


def _plan_causal_conv(name: str, module: nn.Conv3d) -> Callable[..., Any] | None:
    if module.stride[1] != 1 or module.dilation[1] != 1:
        raise NotImplementedError(f"patch-parallel decode needs height stride and dilation 1 ({name})")
    if module.kernel_size[1] == 1:
        return None
    if module._padding[2] != module.kernel_size[1] // 2:
        raise NotImplementedError(f"patch-parallel decode needs 'same' height padding ({name})")
    return causal_conv3d_forward


def _plan_upsample(name: str, module: nn.Upsample) -> None:
    """WanUpsample, QwenImageUpsample: nearest by a whole factor repeats each row."""
    factor = module.scale_factor[0] if isinstance(module.scale_factor, tuple) else module.scale_factor
    if module.mode not in ("nearest", "nearest-exact") or factor is None or not float(factor).is_integer():
        raise NotImplementedError(f"patch-parallel decode needs nearest upsampling by a whole factor ({name})")


def _band_modules(
    causal_conv: type[nn.Conv3d], attention: type[nn.Module], row_local: tuple[type[nn.Module], ...]
) -> BandModules:
    planners = (
        (attention, _plan_attention),
        (causal_conv, _plan_causal_conv),
        (nn.Conv2d, plan_conv2d),
        (nn.Upsample, _plan_upsample),
    )
    return BandModules(planners, (nn.SiLU, nn.Dropout, nn.Identity, *row_local))


WAN_BAND_MODULES = _band_modules(WanCausalConv3d, WanAttentionBlock, (WanRMS_norm, DupUp3D))
QWEN_IMAGE_BAND_MODULES = _band_modules(QwenImageCausalConv3d, QwenImageAttentionBlock, (QwenImageRMS_norm,))
