"""Patch-parallel VAE decode (the Wan and Qwen-Image VAEs): each rank decodes a band of rows, exactly.

Unlike tiled decode (vae_svc/tiled.py), whose blended seams differ from the untiled decode, the ranks split every
frame into horizontal bands and keep the decoder's arithmetic whole, so the output equals the single-device
decode up to float rounding. AutoencoderKLQwenImage is the Wan2.1 VAE under other class names, so one set of band
forwards (`BAND_MODULES`, keyed by the decoder's class) serves both; the Wan names below stand for either.

- Every spatial convolution first receives from its neighbours the `kernel // 2` halo rows above and below its
  band (zeros only at the true image edges), then runs without height padding; width and causal time padding are
  unchanged. The causal feature cache holds band inputs without halo and the halo exchange runs after the cached
  frames are concatenated in time, so each conv sees exactly the rows of the full-frame decode.
- `WanAttentionBlock` computes queries for its own rows and all-gathers the whole frame's keys and values.
- Everything else in the decoder is row-local (per-pixel norms, pointwise activations, 1x1 convs, 2x upsampling).
- Latent rows are divided as evenly as possible, earlier ranks taking the remainder (7 rows on 3 ranks: 3, 2, 2);
  every rank needs at least one latent row, the halo the decoder's convs need.
- The band forwards are installed once (`enable_patch_parallel`) and act only while `row_bands(bands)` is active
  in the calling thread or task, so single-device sessions on the same model are untouched.

The session runs the family's own decode session on its band inside `row_bands`, then gathers the bands.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import (
    QwenImageAttentionBlock,
    QwenImageCausalConv3d,
    QwenImageDecoder3d,
    QwenImageRMS_norm,
)
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    DupUp3D,
    WanAttentionBlock,
    WanCausalConv3d,
    WanDecoder3d,
    WanRMS_norm,
)
from torch import nn

from stagekit.decode import LatentDecoder, to_uint8_frames


@dataclass(frozen=True)
class BandModules:
    """The module classes of one VAE family's decoder that the band forwards recognise.

    `causal_conv`: the causal 3D convolution (an nn.Conv3d with the library's `_padding`, called as
    `(x, cache_x)`); `attention`: the single-head attention over a frame's pixels (`norm`, `to_qkv`,
    `proj`); `row_local`: the family's leaf modules that act on each pixel or row on its own.
    """

    causal_conv: type[nn.Conv3d]
    attention: type[nn.Module]
    row_local: tuple[type[nn.Module], ...]


# By the class of the VAE's decoder (`vae.decoder`). Wan2.2's `DupUp3D` shortcut repeats each row.
BAND_MODULES: dict[type[nn.Module], BandModules] = {
    WanDecoder3d: BandModules(WanCausalConv3d, WanAttentionBlock, (WanRMS_norm, DupUp3D)),
    QwenImageDecoder3d: BandModules(QwenImageCausalConv3d, QwenImageAttentionBlock, (QwenImageRMS_norm,)),
}

# Generic module types that only mix channels or act on each row on its own (checked when enabling, with
# the family's own, so a future decoder with a new whole-frame op fails loudly instead of decoding wrong
# seams). `nn.Upsample` is checked separately: nearest by a whole factor.
_ROW_LOCAL_TYPES: tuple[type[nn.Module], ...] = (
    nn.SiLU,
    nn.Dropout,
    nn.Identity,
)

_ACTIVE_BANDS: contextvars.ContextVar[RowBands | None] = contextvars.ContextVar("vae_row_bands", default=None)


def band_modules_for(decoder: nn.Module) -> BandModules:
    """The band module classes of `decoder` (a VAE's `vae.decoder`); NotImplementedError for other decoders."""
    for decoder_class, modules in BAND_MODULES.items():
        if isinstance(decoder, decoder_class):
            return modules
    known = ", ".join(cls.__name__ for cls in BAND_MODULES)
    raise NotImplementedError(
        f"patch-parallel decode does not know the decoder {type(decoder).__name__}; it splits {known}"
    )


def band_rows(height: int, world_size: int) -> list[int]:
    """Latent rows per rank: as even as possible, earlier ranks taking the remainder."""
    if world_size < 1:
        raise ValueError(f"patch-parallel world size must be at least 1, got {world_size}")
    if height < world_size:
        raise ValueError(
            f"latent height {height} is smaller than the patch-parallel world size {world_size}: "
            f"each rank needs at least 1 latent row (use at most {height} ranks or a taller video)"
        )
    base, remainder = divmod(height, world_size)
    return [base + (1 if rank < remainder else 0) for rank in range(world_size)]


@dataclass(frozen=True)
class RowBands:
    """Which latent rows each rank of `group` holds, and how to reach its neighbours."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    latent_rows: tuple[int, ...]

    @property
    def latent_start(self) -> int:
        return sum(self.latent_rows[: self.rank])

    @property
    def latent_stop(self) -> int:
        return self.latent_start + self.latent_rows[self.rank]

    def rows_per_rank(self, local_rows: int) -> list[int]:
        """Every rank's band height at the resolution where this rank's band has `local_rows` rows."""
        scale, leftover = divmod(local_rows, self.latent_rows[self.rank])
        if leftover or scale < 1:
            raise RuntimeError(
                f"band of {local_rows} rows is not a whole multiple of this rank's {self.latent_rows[self.rank]} "
                "latent rows"
            )
        return [rows * scale for rows in self.latent_rows]

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


@contextlib.contextmanager
def row_bands(bands: RowBands) -> Iterator[None]:
    """Makes patched decoder modules compute on `bands` in this thread/task for the duration."""
    token = _ACTIVE_BANDS.set(bands)
    try:
        yield
    finally:
        _ACTIVE_BANDS.reset(token)


# --- communication ----------------------------------------------------------------------------------


def exchange_halos(x: torch.Tensor, halo: int, bands: RowBands) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The `halo` rows (dim -2) just above and below this rank's band; None at the true image edges."""
    rows = x.shape[-2]
    if rows < halo:
        raise ValueError(f"band of {rows} rows is thinner than the convolution halo of {halo} rows")
    has_above = bands.rank > 0
    has_below = bands.rank < bands.world_size - 1
    above = torch.empty_like(x[..., :halo, :]) if has_above else None
    below = torch.empty_like(x[..., :halo, :]) if has_below else None
    ops = []
    if has_above:
        peer = bands.global_rank(bands.rank - 1)
        ops.append(dist.P2POp(dist.isend, x[..., :halo, :].contiguous(), peer, bands.group))
        ops.append(dist.P2POp(dist.irecv, above, peer, bands.group))
    if has_below:
        peer = bands.global_rank(bands.rank + 1)
        ops.append(dist.P2POp(dist.isend, x[..., rows - halo :, :].contiguous(), peer, bands.group))
        ops.append(dist.P2POp(dist.irecv, below, peer, bands.group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return above, below


def gather_rows(x: torch.Tensor, bands: RowBands, dst: int | None = None) -> torch.Tensor | None:
    """Concatenates every rank's band (dim -2) into the full frame, on all ranks or on group rank `dst` only.

    Bands may differ in height by one latent row's worth, so they are padded to the tallest for the
    collective and trimmed after. Returns None on ranks other than `dst`.
    """
    if bands.world_size == 1:
        return x
    rows = bands.rows_per_rank(x.shape[-2])
    tallest = max(rows)
    padded = F.pad(x, (0, 0, 0, tallest - x.shape[-2])).contiguous()
    parts: list[torch.Tensor] | None
    if dst is None:
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=bands.group)
    else:
        parts = [torch.empty_like(padded) for _ in rows] if bands.rank == dst else None
        dist.gather(padded, parts, dst=bands.global_rank(dst), group=bands.group)
        if parts is None:
            return None
    return torch.cat([part[..., :height, :] for part, height in zip(parts, rows, strict=True)], dim=-2)


def _place_halos(
    padded: torch.Tensor, above: torch.Tensor | None, below: torch.Tensor | None, halo: int, time_front: int, width: int
) -> None:
    """Writes received halo rows into a tensor already zero-padded in time (front), height and width."""
    columns = slice(width, padded.shape[-1] - width)
    frames = (slice(time_front, None),) if padded.dim() == 5 else ()
    if above is not None:
        padded[(slice(None), slice(None), *frames, slice(0, halo), columns)] = above
    if below is not None:
        padded[(slice(None), slice(None), *frames, slice(padded.shape[-2] - halo, None), columns)] = below


# --- patched forwards -------------------------------------------------------------------------------


def _convolve(conv: nn.Conv2d | nn.Conv3d, padded: torch.Tensor) -> torch.Tensor:
    """The convolution of an already padded band, with no further padding.

    On the CPU, PyTorch picks its kernel by input size and hands band-sized inputs to the reference
    `slow_conv3d`, much slower than the oneDNN kernel a whole frame gets (BENCHMARKS.md, "VAE decode"), so
    patch parallelism would lose on every rank what it gains by splitting. Bands therefore call oneDNN
    directly where it is available (same arithmetic up to float rounding order).
    """
    dims = padded.dim() - 2
    if padded.device.type == "cpu" and torch.backends.mkldnn.is_available() and padded.dtype == torch.float32:
        return torch.ops.aten.mkldnn_convolution(
            padded.contiguous(),
            conv.weight,
            conv.bias,
            [0] * dims,
            list(conv.stride),
            list(conv.dilation),
            conv.groups,
        )
    convolve = F.conv3d if dims == 3 else F.conv2d
    return convolve(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def _causal_conv3d_forward(self: nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """The causal conv's forward (WanCausalConv3d, QwenImageCausalConv3d) with the height padding replaced
    by neighbour rows (zeros at the image edges)."""
    bands = _ACTIVE_BANDS.get()
    if bands is None or bands.world_size == 1:
        return type(self).forward(self, x, cache_x)
    width, _, halo, _, time_front, _ = self._padding
    if cache_x is not None and time_front > 0:
        # As the library does: prepend the cached frames (band rows only), pad the rest of the time window.
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        time_front -= cache_x.shape[2]
    above, below = exchange_halos(x, halo, bands)
    padded = F.pad(x, (width, width, halo, halo, time_front, 0))
    _place_halos(padded, above, below, halo, time_front, width)
    return _convolve(self, padded)


def _conv2d_forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """nn.Conv2d.forward ('same' zero padding) with the height padding replaced by neighbour rows."""
    bands = _ACTIVE_BANDS.get()
    if bands is None or bands.world_size == 1:
        return nn.Conv2d.forward(self, x)
    halo, width = self.padding
    above, below = exchange_halos(x, halo, bands)
    padded = F.pad(x, (width, width, halo, halo))
    _place_halos(padded, above, below, halo, 0, width)
    return _convolve(self, padded)


def _attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention block's forward (WanAttentionBlock, QwenImageAttentionBlock: the same arithmetic) with
    local query rows against the whole frame's keys and values."""
    bands = _ACTIVE_BANDS.get()
    if bands is None or bands.world_size == 1:
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


# --- installing -------------------------------------------------------------------------------------


def _spatial_modules(decoder: nn.Module) -> Iterator[tuple[nn.Module, Callable[..., Any]]]:
    """(module, band forward) for every decoder module that needs rows beyond its band."""
    classes = band_modules_for(decoder)
    row_local = _ROW_LOCAL_TYPES + classes.row_local
    covered: set[int] = set()
    for name, module in decoder.named_modules():
        if id(module) in covered:
            continue
        if isinstance(module, classes.attention):
            covered.update(id(m) for m in module.modules())
            yield module, _attention_forward
        elif isinstance(module, classes.causal_conv):
            if module.stride[1] != 1 or module.dilation[1] != 1:
                raise NotImplementedError(f"patch-parallel decode needs height stride and dilation 1 ({name})")
            if module.kernel_size[1] > 1:
                if module._padding[2] != module.kernel_size[1] // 2:
                    raise NotImplementedError(f"patch-parallel decode needs 'same' height padding ({name})")
                yield module, _causal_conv3d_forward
        elif isinstance(module, nn.Conv2d):
            if module.stride[0] != 1 or module.dilation[0] != 1 or module.padding_mode != "zeros":
                raise NotImplementedError(f"patch-parallel decode needs height stride 1 and zero padding ({name})")
            if module.kernel_size[0] > 1:
                if module.padding[0] != module.kernel_size[0] // 2:
                    raise NotImplementedError(f"patch-parallel decode needs 'same' height padding ({name})")
                yield module, _conv2d_forward
        elif isinstance(module, nn.Upsample):  # WanUpsample, QwenImageUpsample
            factor = module.scale_factor[0] if isinstance(module.scale_factor, tuple) else module.scale_factor
            if module.mode not in ("nearest", "nearest-exact") or factor is None or not float(factor).is_integer():
                raise NotImplementedError(f"patch-parallel decode needs nearest upsampling by a whole factor ({name})")
        elif not list(module.children()) and not isinstance(module, row_local):
            raise NotImplementedError(
                f"patch-parallel decode does not know whether {type(module).__name__} ({name}) is row-local"
            )


_BAND_FORWARDS = (_causal_conv3d_forward, _conv2d_forward, _attention_forward)


def _installed_forward(module: nn.Module) -> Callable[..., Any] | None:
    """The function of the instance-level forward on `module`, if any."""
    forward = module.__dict__.get("forward")
    return None if forward is None else getattr(forward, "__func__", forward)


def enable_patch_parallel(decoder: nn.Module) -> int:
    """Installs the band forwards on `decoder`'s spatial modules (idempotent); returns how many.

    The modules behave as before unless `row_bands` is active, so this is safe on a shared model.
    Raises NotImplementedError if the decoder is not one `BAND_MODULES` knows or holds an op this module
    cannot split by rows, and
    RuntimeError if a module's forward was already replaced by something else (e.g. an offload hook),
    since the band forward would silently bypass it.
    """
    modules = list(_spatial_modules(decoder))
    for module, forward in modules:
        installed = _installed_forward(module)
        if installed is not None and installed is not forward:
            raise RuntimeError(f"{type(module).__name__} already has a replaced forward ({installed!r})")
    for module, forward in modules:
        module.forward = types.MethodType(forward, module)
    return len(modules)


def disable_patch_parallel(decoder: nn.Module) -> None:
    """Restores the library forwards where `enable_patch_parallel` installed band forwards."""
    for module in decoder.modules():
        if _installed_forward(module) in _BAND_FORWARDS:
            del module.forward


# --- the session ------------------------------------------------------------------------------------


class PatchParallelDecodeSession:
    """One request's decode on a patch-parallel group: same interface as `DecodeSession`.

    Every rank of `group` (None: the default group, or a single device when torch.distributed is not
    initialised) calls `decode_next` with the same full latent frame, in the same order; each runs the
    family's decode session (`decoder.session()`) on its band of latent rows, so a Wan session keeps the
    causal cache of its own band across frames and a Qwen-Image one decodes its image's frame whole
    but for the band split. The full frames come back on every rank, or only on group rank
    `output_rank` if given (the others get None, and skip holding full frames). Collectives must be
    issued in the same order on every rank, so sessions sharing a group decode one at a time.
    """

    def __init__(
        self,
        decoder: LatentDecoder,
        group: dist.ProcessGroup | None = None,
        output_rank: int | None = None,
    ) -> None:
        self.decoder = decoder
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        elif group is None:
            self.rank, self.world_size = 0, 1
        else:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        if self.rank < 0:
            raise ValueError("this process is not a member of the patch-parallel group")
        if output_rank is not None and not 0 <= output_rank < self.world_size:
            raise ValueError(f"output_rank must be in [0, {self.world_size}), got {output_rank}")
        self.output_rank = output_rank
        enable_patch_parallel(decoder.vae.decoder)
        self.band_session = decoder.session()
        self.bands: RowBands | None = None
        self.latent_width: int | None = None
        self.frames_decoded = 0

    def _bands_for(self, latent_frame: torch.Tensor) -> RowBands:
        height, width = latent_frame.shape[-2:]
        if self.bands is None:
            rows = band_rows(height, self.world_size)
            self.bands = RowBands(self.group, self.rank, self.world_size, tuple(rows))
            self.latent_width = width
        elif (height, width) != (sum(self.bands.latent_rows), self.latent_width):
            raise ValueError(
                f"latent frame is {height}x{width} but this request started at "
                f"{sum(self.bands.latent_rows)}x{self.latent_width}"
            )
        return self.bands

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor | None:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the clamped decoder output [1, 3, n, H, W]."""
        bands = self._bands_for(latent_frame)
        # Denormalising, the 1x1x1 post-quant conv, unpatchifying and clamping act on each row on its own.
        with row_bands(bands):
            band = self.band_session.decode_next_float(latent_frame[..., bands.latent_start : bands.latent_stop, :])
        self.frames_decoded += band.shape[2]
        return gather_rows(band, bands, dst=self.output_rank)

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor | None:
        """Decodes latent frame [1, C, 1, h, w] (float32, normalised) to uint8 frames [n, H, W, 3]."""
        out = self.decode_next_float(latent_frame)
        return None if out is None else to_uint8_frames(out)
