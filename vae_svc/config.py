"""The VAE stage's configuration: built once in `main` from its parsed options, checked, then handed down.

`VaeConfig` embeds the configuration every stage shares (services/stage_config.py) and adds how frames are
decoded: split by rows over a patch-parallel group (exact) or in tiles on one device (approximate), never both.
A family that does not support one refuses its flag with the registry's reason; nothing below `main` reads the
parsed options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from services.stage_config import StageConfig


@dataclass(frozen=True)
class TileConfig:
    """The tiles of a tiled decode, in pixels (vae_svc/tiled.py)."""

    min_height: int
    """Tile height (--vae-tile-sample-min-height)."""
    min_width: int
    """Tile width (--vae-tile-sample-min-width)."""
    stride_height: int
    """Vertical stride between tiles, 1 up to the tile height (--vae-tile-sample-stride-height)."""
    stride_width: int
    """Horizontal stride between tiles, 1 up to the tile width (--vae-tile-sample-stride-width)."""


@dataclass(frozen=True)
class DecodeConfig:
    """How the stage decodes latents into frames."""

    patch_parallel_size: int
    """Ranks the rows of each frame are split over, 1 or more (--vae-patch-parallel-size)."""
    use_tiling: bool
    """Decode in overlapping tiles on one device (--vae-use-tiling); exclusive with patch parallelism."""
    tile: TileConfig
    """The tiles' sizes and strides, used with `use_tiling`."""

    def __post_init__(self) -> None:
        if self.patch_parallel_size < 1:
            raise ValueError(f"--vae-patch-parallel-size {self.patch_parallel_size}: must be >= 1")
        if self.use_tiling and self.patch_parallel_size > 1:
            raise ValueError(
                "--vae-use-tiling and --vae-patch-parallel-size > 1 are exclusive: "
                "patch parallel is exact and spreads memory over ranks; tiling is approximate, for one device"
            )
        for name, size, stride in (
            ("height", self.tile.min_height, self.tile.stride_height),
            ("width", self.tile.min_width, self.tile.stride_width),
        ):
            if self.use_tiling and not 0 < stride <= size:
                raise ValueError(
                    f"--vae-tile-sample-stride-{name} {stride} must be in 1..{size} "
                    f"(the tile {name}), so that tiles overlap or touch"
                )

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> DecodeConfig:
        """The decoding the parsed options ask for; raises ValueError naming the first impossible setting."""
        return cls(
            patch_parallel_size=args.vae_patch_parallel_size,
            use_tiling=args.vae_use_tiling,
            tile=TileConfig(
                min_height=args.vae_tile_sample_min_height,
                min_width=args.vae_tile_sample_min_width,
                stride_height=args.vae_tile_sample_stride_height,
                stride_width=args.vae_tile_sample_stride_width,
            ),
        )


@dataclass(frozen=True)
class VaeConfig:
    """What `stagediff serve vae` runs with (vae_svc/options.py has each flag's help)."""

    stage: StageConfig
    """The options every stage shares: checkpoint, device, server."""
    decode: DecodeConfig
    """How latents are decoded."""

    def __post_init__(self) -> None:
        family = self.stage.checkpoint.traits if self.stage.checkpoint is not None else None
        for used, flag, feature in (
            (self.decode.patch_parallel_size > 1, "--vae-patch-parallel-size", "vae_patch_parallel"),
            (self.decode.use_tiling, "--vae-use-tiling", "vae_tiling"),
        ):
            if used and family is not None and not family.support(feature).supported:
                raise ValueError(f"the {family.name} family does not support {flag}: {family.support(feature).reason}")
        size = self.decode.patch_parallel_size
        if self.stage.device.startswith("cuda") and size > torch.cuda.device_count():
            raise ValueError(
                f"--vae-patch-parallel-size {size} needs that many GPUs; {torch.cuda.device_count()} are visible"
            )

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> VaeConfig:
        """The configuration the parsed options give; raises ValueError (CheckpointError included) naming the
        first impossible setting."""
        decode = DecodeConfig.from_options(args)
        return cls(stage=StageConfig.from_options("vae", args), decode=decode)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VaeConfig:
        """`from_options`, exiting with `stagediff serve vae: <problem>` instead of raising."""
        try:
            return cls.from_options(args)
        except ValueError as error:
            raise SystemExit(f"stagediff serve vae: {error}") from None
