"""Patch-parallel VAE decode: each rank decodes a band of rows of every frame, exactly.

Unlike tiled decode (vae_svc/tiled.py), whose blended seams differ from the untiled decode, the ranks split every
frame into horizontal bands and keep the decoder's arithmetic whole, so the output equals the single-device
decode up to float rounding. Each decoder the stage can split has a set of band forwards, keyed by the class of
the VAE's decoder in `BAND_MODULES`:

- the Wan and Qwen-Image VAEs' causal 3D decoders (vae_svc/band_wan.py): halo rows before each spatial conv,
  attention against the whole frame's keys and values;
- diffusers' 2D `Decoder` of AutoencoderKL (FLUX.1, Z-Image) and AutoencoderKLFlux2 (FLUX.2 klein)
  (vae_svc/band_kl.py): the same, and GroupNorms normalising every band with the whole image's statistics;
- the HunyuanVideo 1.5 VAE's causal 3D decoder (vae_svc/band_hunyuanvideo15.py): halo rows before each spatial
  conv, attention against the whole frames' keys and values, both on top of the family's stream cache.

vae_svc/row_bands.py holds the band layout (latent rows divided as evenly as possible, at least one per rank)
and the collectives. The band forwards are installed once (`enable_patch_parallel`), after every module of the
decoder is checked to be one the family's set can split, and act only while `row_bands(bands)` is active in the
calling thread or task, so single-device sessions on the same model are untouched. Where the family has installed
forwards of its own that a band forward takes the place of (HunyuanVideo 1.5's stream forwards, `BandModules.replaces`),
the band forward calls them while no bands are active and `disable_patch_parallel` puts them back.

The session runs the family's own decode session on its band inside `row_bands`, then gathers the bands: what
the session does around the decoder (denormalising, unpatchifying, 1x1 post-quant convs, clamping) acts on each
row on its own.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15Decoder3D
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageDecoder3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanDecoder3d
from diffusers.models.autoencoders.vae import Decoder
from torch import nn

from stagekit.decode import LatentDecoder, to_uint8_frames
from vae_svc.band_hunyuanvideo15 import HUNYUANVIDEO15_BAND_MODULES
from vae_svc.band_kl import KL_BAND_MODULES
from vae_svc.band_wan import QWEN_IMAGE_BAND_MODULES, WAN_BAND_MODULES
from vae_svc.row_bands import BandModules, RowBands, band_rows, gather_rows, is_band_forward, row_bands

__all__ = [
    "BAND_MODULES",
    "PatchParallelDecodeSession",
    "band_modules_for",
    "band_rows",
    "disable_patch_parallel",
    "enable_patch_parallel",
]

# By the class of the VAE's decoder (`vae.decoder`). `Decoder` is AutoencoderKL's and AutoencoderKLFlux2's.
BAND_MODULES: dict[type[nn.Module], BandModules] = {
    WanDecoder3d: WAN_BAND_MODULES,
    QwenImageDecoder3d: QWEN_IMAGE_BAND_MODULES,
    Decoder: KL_BAND_MODULES,
    HunyuanVideo15Decoder3D: HUNYUANVIDEO15_BAND_MODULES,
}

# The family forwards a band forward took the place of (`BandModules.replaces`), to put back on disable.
_REPLACED_FORWARDS: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()


def band_modules_for(decoder: nn.Module) -> BandModules:
    """The band forwards of `decoder` (a VAE's `vae.decoder`); NotImplementedError for other decoders."""
    for decoder_class, modules in BAND_MODULES.items():
        if isinstance(decoder, decoder_class):
            return modules
    known = ", ".join(cls.__name__ for cls in BAND_MODULES)
    raise NotImplementedError(
        f"patch-parallel decode does not know the decoder {type(decoder).__name__}; it splits {known}"
    )


def _spatial_modules(decoder: nn.Module) -> Iterator[tuple[nn.Module, Callable[..., Any]]]:
    """(module, band forward) for every decoder module that needs rows beyond its band; raises
    NotImplementedError for a module the family's set cannot split."""
    modules = band_modules_for(decoder)
    covered: set[int] = set()
    for name, module in decoder.named_modules():
        if id(module) in covered:
            continue
        planner = next((plan for cls, plan in modules.planners if isinstance(module, cls)), None)
        if planner is not None:
            forward = planner(name or type(module).__name__, module)
            if forward is not None:
                covered.update(id(m) for m in module.modules())
                yield module, forward
        elif not list(module.children()) and not isinstance(module, modules.row_local):
            raise NotImplementedError(
                f"patch-parallel decode does not know whether {type(module).__name__} ({name}) is row-local"
            )


def _installed_forward(module: nn.Module) -> Callable[..., Any] | None:
    """The function of the instance-level forward on `module`, if any."""
    forward = module.__dict__.get("forward")
    return None if forward is None else getattr(forward, "__func__", forward)


def enable_patch_parallel(decoder: nn.Module) -> int:
    """Installs the band forwards on `decoder`'s spatial modules (idempotent); returns how many.

    The modules behave as before unless `row_bands` is active, so this is safe on a shared model.
    Raises NotImplementedError if the decoder is not one `BAND_MODULES` knows or holds an op its set
    cannot split by rows, and
    RuntimeError if a module's forward was already replaced by something other than a family forward the set
    replaces (e.g. an offload hook), since the band forward would silently bypass it.
    """
    replaceable = band_modules_for(decoder).replaces
    modules = list(_spatial_modules(decoder))
    for module, forward in modules:
        installed = _installed_forward(module)
        if installed is not None and installed is not forward and installed not in replaceable:
            raise RuntimeError(f"{type(module).__name__} already has a replaced forward ({installed!r})")
    for module, forward in modules:
        installed = _installed_forward(module)
        if installed is forward:
            continue
        if installed is not None:
            _REPLACED_FORWARDS[module] = installed
        module.forward = types.MethodType(forward, module)
    return len(modules)


def disable_patch_parallel(decoder: nn.Module) -> None:
    """Restores the forwards where `enable_patch_parallel` installed band forwards: the family's own forward
    where a band forward replaced one, the library's elsewhere."""
    for module in decoder.modules():
        if is_band_forward(_installed_forward(module)):
            del module.forward
            replaced = _REPLACED_FORWARDS.pop(module, None)
            if replaced is not None:
                module.forward = types.MethodType(replaced, module)


# --- the session ------------------------------------------------------------------------------------


class PatchParallelDecodeSession:
    """One request's decode on a patch-parallel group: same interface as `DecodeSession`.

    Every rank of `group` (None: the default group, or a single device when torch.distributed is not
    initialised) calls `decode_next` with the same full latent frame, in the same order; each runs the
    family's decode session (`decoder.session()`) on its band of latent rows, so a Wan or HunyuanVideo 1.5
    session keeps the causal cache of its own band across frames and an image family's (Qwen-Image, FLUX.1, Z-Image,
    FLUX.2 klein) decodes its image's one frame. The full frames come back on every rank, or only on group rank
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
        # Denormalising, the 1x1 post-quant convs, unpatchifying and clamping act on each row on its own.
        with row_bands(bands):
            band = self.band_session.decode_next_float(latent_frame[..., bands.latent_start : bands.latent_stop, :])
        self.frames_decoded += band.shape[2]
        return gather_rows(band, bands, dst=self.output_rank)

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor | None:
        """Decodes latent frame [1, C, 1, h, w] (float32, normalised) to uint8 frames [n, H, W, 3]."""
        out = self.decode_next_float(latent_frame)
        return None if out is None else to_uint8_frames(out)
