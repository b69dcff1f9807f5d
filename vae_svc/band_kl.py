"""Band forwards of diffusers' 2D VAE decoder (`diffusers.models.autoencoders.vae.Decoder`), the decoder of
AutoencoderKL (FLUX.1, Z-Image) and of AutoencoderKLFlux2 (FLUX.2 klein).

The decoder is conv_in, a UNetMidBlock2D (ResnetBlock2D, Attention, ResnetBlock2D), UpDecoderBlock2Ds
(ResnetBlock2Ds, then Upsample2D: nearest 2x and a 3x3 conv), GroupNorm, SiLU and conv_out. Split by rows
(vae_svc/row_bands.py has the band layout):

- Every 3x3 convolution takes its halo rows from the neighbours (the shared 2D band forward).
- GroupNorm is not row-local: each group's mean and variance run over the whole image. Every rank sums its band
  per (sample, group) in float32, as torch's group_norm computes for float32, bfloat16 and float16 inputs alike;
  the sums are all-reduced for the whole image's mean, then the squared deviations from that mean are summed and
  all-reduced for its (biased) variance. Two passes, not one pass of sums and sums of squares, because E[x^2] -
  E[x]^2 cancels in float32 when a group's mean is large next to its spread. The element count of a group is the
  whole image's rows times the band width times the group's channels, known on every rank from the band layout.
- The mid-block `Attention` computes its queries on its own rows and all-gathers the whole frame's keys and values
  (after the band GroupNorm above, so the keys are those of the whole decode).
- Nearest 2x upsampling repeats each row; SiLU is pointwise; 1x1 convs and linears mix channels: row-local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

from vae_svc.row_bands import (
    BandModules,
    RowBands,
    active_bands,
    all_reduce_sum,
    band_forward,
    gather_rows,
    plan_conv2d,
)


def band_group_norm(norm: nn.GroupNorm, x: torch.Tensor, bands: RowBands) -> torch.Tensor:
    """`norm(x)` of a band x [B, C, h, W] with the whole image's per-group statistics."""
    batch, channels, height, width = x.shape
    groups = norm.num_groups
    grouped = x.float().reshape(batch, groups, -1)
    count = sum(bands.rows_per_rank(height)) * width * (channels // groups)
    mean = all_reduce_sum(grouped.sum(dim=-1), bands) / count
    centered = grouped - mean.unsqueeze(-1)
    variance = all_reduce_sum(centered.square().sum(dim=-1), bands) / count
    normalised = (centered * torch.rsqrt(variance + norm.eps).unsqueeze(-1)).reshape(batch, channels, height, width)
    if norm.affine:
        normalised = normalised * norm.weight.float().view(1, -1, 1, 1) + norm.bias.float().view(1, -1, 1, 1)
    return normalised.to(x.dtype)


@band_forward
def group_norm_forward(self: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """nn.GroupNorm.forward of a band [B, C, h, W], normalised with the whole image's statistics."""
    bands = active_bands()
    if bands is None:
        return nn.GroupNorm.forward(self, x)
    return band_group_norm(self, x, bands)


@band_forward
def attention_forward(
    self: Attention,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **cross_attention_kwargs: Any,
) -> torch.Tensor:
    """The mid block's self-attention (Attention with AttnProcessor2_0 on a [B, C, h, W] band): the band's
    queries against the whole frame's keys and values."""
    bands = active_bands()
    if bands is None:
        return Attention.forward(self, hidden_states, encoder_hidden_states, attention_mask, **cross_attention_kwargs)
    if encoder_hidden_states is not None or attention_mask is not None:
        raise NotImplementedError("patch-parallel decode splits self-attention without a mask only")
    residual = hidden_states
    batch, channels, height, width = hidden_states.shape
    if self.group_norm is not None:
        hidden_states = band_group_norm(self.group_norm, hidden_states, bands)
    tokens = hidden_states.view(batch, channels, height * width).transpose(1, 2)
    query = self.to_q(tokens)
    key, value = self.to_k(tokens), self.to_v(tokens)

    def whole_frame(band_tokens: torch.Tensor) -> torch.Tensor:  # [B, h*W, D] of the band -> [B, H*W, D]
        rows = band_tokens.transpose(1, 2).reshape(batch, -1, height, width)
        frame = gather_rows(rows, bands)
        assert frame is not None  # gathered on every rank
        return frame.flatten(2).transpose(1, 2)

    key, value = whole_frame(key), whole_frame(value)
    head_dim = key.shape[-1] // self.heads

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, heads, N, head_dim]
        return t.view(batch, -1, self.heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(query), heads(key), heads(value), dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(batch, -1, self.heads * head_dim).to(query.dtype)
    out = self.to_out[1](self.to_out[0](out))
    out = out.transpose(-1, -2).reshape(batch, channels, height, width)
    if self.residual_connection:
        out = out + residual
    return out / self.rescale_output_factor


def _plan_group_norm(name: str, module: nn.GroupNorm) -> Callable[..., Any]:
    return group_norm_forward


def _plan_attention(name: str, module: Attention) -> Callable[..., Any]:
    """Self-attention over a frame's pixels, as the processor computes it; anything else is refused."""
    if type(module.processor) is not AttnProcessor2_0:
        raise NotImplementedError(
            f"patch-parallel decode splits Attention with AttnProcessor2_0 only ({name}: "
            f"{type(module.processor).__name__})"
        )
    if module.spatial_norm is not None or module.norm_q is not None or module.norm_k is not None:
        raise NotImplementedError(f"patch-parallel decode splits Attention without spatial or q/k norms ({name})")
    if module.group_norm is not None and not isinstance(module.group_norm, nn.GroupNorm):
        raise NotImplementedError(f"patch-parallel decode needs the attention's norm to be a GroupNorm ({name})")
    return attention_forward


def _plan_upsample(name: str, module: Upsample2D) -> None:
    """Nearest 2x interpolation (then the conv, which its own planner splits): repeats each row."""
    if module.norm is not None or module.use_conv_transpose or not module.interpolate:
        raise NotImplementedError(f"patch-parallel decode needs nearest-interpolating Upsample2D without norm ({name})")


def _plan_resnet(name: str, module: ResnetBlock2D) -> None:
    """The block runs its norms, convs and shortcut in turn; its own up- or downsampling would change rows."""
    if module.up or module.down:
        raise NotImplementedError(f"patch-parallel decode needs ResnetBlock2D without up- or downsampling ({name})")


def _plan_decoder(name: str, module: Decoder) -> None:
    """The 'group' norm type; the 'spatial' one (SpatialNorm) interpolates the latents to every resolution."""
    if not isinstance(module.conv_norm_out, nn.GroupNorm):
        raise NotImplementedError(
            f"patch-parallel decode needs the Decoder's GroupNorm, not {type(module.conv_norm_out).__name__}"
        )


KL_BAND_MODULES = BandModules(
    planners=(
        (Decoder, _plan_decoder),
        (Attention, _plan_attention),
        (ResnetBlock2D, _plan_resnet),
        (Upsample2D, _plan_upsample),
        (nn.GroupNorm, _plan_group_norm),
        (nn.Conv2d, plan_conv2d),
    ),
    row_local=(nn.SiLU, nn.Dropout, nn.Identity),
)
