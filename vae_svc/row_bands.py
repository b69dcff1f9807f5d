"""The row bands of a patch-parallel VAE decode: who holds which rows, how ranks exchange them, and what every
family's band forwards share.

Patch-parallel decode (vae_svc/patch_parallel.py) splits every frame into horizontal bands, one per rank. This
module holds what does not depend on the decoder's family:

- `band_rows` divides the latent rows as evenly as possible, earlier ranks taking the remainder (7 rows on 3
  ranks: 3, 2, 2); every rank needs at least one latent row, the halo the decoders' convs need.
- `RowBands` says which rows this rank holds; `row_bands(bands)` makes it active in the calling thread or task.
  Band forwards act only while a `RowBands` is active (`active_bands`), so a model whose modules carry band
  forwards still decodes whole in single-device sessions.
- The collectives: `exchange_halos` (rows just above and below the band, from the neighbours),
  `gather_rows` (the whole frame from every band) and `all_reduce_sum` (statistics over the whole frame).
- `BandModules`, what each family's set of band forwards declares (vae_svc/band_wan.py, vae_svc/band_kl.py,
  vae_svc/band_hunyuanvideo15.py), the `band_forward` registry of every band forward, and the 2D convolution's
  band forward the Wan and KL sets use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_ACTIVE_BANDS: contextvars.ContextVar[RowBands | None] = contextvars.ContextVar("vae_row_bands", default=None)

# A planner checks that one decoder module can be split by rows (NotImplementedError naming it otherwise) and
# returns the band forward to install on it, or None where the module needs none.
Planner = Callable[[str, Any], Callable[..., Any] | None]


@dataclass(frozen=True)
class BandModules:
    """How one VAE family's decoder is split by rows (`patch_parallel.BAND_MODULES` keys them by decoder class).

    `planners`: (module class, planner) pairs, the first class a module is an instance of choosing its planner.
    A module given a band forward computes its submodules itself (they are not visited); one the planner
    returns None for is only checked, and its submodules are visited on their own.
    `row_local`: the family's leaf module classes that act on each pixel or row on its own; any other leaf
    without a planner is refused, so a decoder with a new whole-frame op fails loudly instead of decoding
    wrong seams.
    `replaces`: forwards the family itself installs on its decoder's modules (HunyuanVideo 1.5's stream
    forwards, families/hunyuanvideo_15/decode.py) that band forwards may take the place of. Such a band forward
    does what the forward it replaces does besides the bands, and calls it while no bands are active;
    `patch_parallel.disable_patch_parallel` puts it back.
    """

    planners: tuple[tuple[type[nn.Module], Planner], ...]
    row_local: tuple[type[nn.Module], ...]
    replaces: tuple[Callable[..., Any], ...] = ()


_BAND_FORWARDS: set[Callable[..., Any]] = set()


def band_forward(function: Callable[..., Any]) -> Callable[..., Any]:
    """Registers `function` as a band forward (what `patch_parallel.disable_patch_parallel` removes)."""
    _BAND_FORWARDS.add(function)
    return function


def is_band_forward(function: Callable[..., Any] | None) -> bool:
    return function in _BAND_FORWARDS


def band_rows(height: int, world_size: int) -> list[int]:
    """Latent rows per rank: as even as possible, earlier ranks taking the remainder."""
    if world_size < 1:
        raise ValueError(f"patch-parallel world size must be at least 1, got {world_size}")
    if height < world_size:
        raise ValueError(
            f"latent height {height} is smaller than the patch-parallel world size {world_size}: "
            f"each rank needs at least 1 latent row (use at most {height} ranks or a taller image)"
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


def active_bands() -> RowBands | None:
    """The bands a band forward computes on: None (or one rank) means the library's own forward."""
    bands = _ACTIVE_BANDS.get()
    return None if bands is None or bands.world_size == 1 else bands


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


def all_reduce_sum(x: torch.Tensor, bands: RowBands) -> torch.Tensor:
    """The elementwise sum of `x` over every rank of the band group (a new tensor; `x` is left as it was)."""
    total = x.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=bands.group)
    return total


# --- the 2D convolution, shared by the band sets ----------------------------------------------------


def place_halos(
    padded: torch.Tensor, above: torch.Tensor | None, below: torch.Tensor | None, halo: int, time_front: int, width: int
) -> None:
    """Writes received halo rows into a tensor already zero-padded in time (front), height and width."""
    columns = slice(width, padded.shape[-1] - width)
    frames = (slice(time_front, None),) if padded.dim() == 5 else ()
    if above is not None:
        padded[(slice(None), slice(None), *frames, slice(0, halo), columns)] = above
    if below is not None:
        padded[(slice(None), slice(None), *frames, slice(padded.shape[-2] - halo, None), columns)] = below


def convolve(conv: nn.Conv2d | nn.Conv3d, padded: torch.Tensor) -> torch.Tensor:
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
    convolve_nd = F.conv3d if dims == 3 else F.conv2d
    return convolve_nd(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


@band_forward
def conv2d_forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """nn.Conv2d.forward ('same' zero padding) with the height padding replaced by neighbour rows."""
    bands = active_bands()
    if bands is None:
        return nn.Conv2d.forward(self, x)
    halo, width = self.padding
    above, below = exchange_halos(x, halo, bands)
    padded = F.pad(x, (width, width, halo, halo))
    place_halos(padded, above, below, halo, 0, width)
    return convolve(self, padded)


def plan_conv2d(name: str, module: nn.Conv2d) -> Callable[..., Any] | None:
    """Height stride and dilation 1, 'same' zero padding: halo rows for kernels taller than 1, none else."""
    if module.stride[0] != 1 or module.dilation[0] != 1 or module.padding_mode != "zeros":
        raise NotImplementedError(f"patch-parallel decode needs height stride 1 and zero padding ({name})")
    if module.kernel_size[0] == 1:
        return None
    if module.padding[0] != module.kernel_size[0] // 2:
        raise NotImplementedError(f"patch-parallel decode needs 'same' height padding ({name})")
    return conv2d_forward
