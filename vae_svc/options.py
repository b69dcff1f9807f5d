"""The options of `stagediff serve vae` (no torch here: `stagediff up` and the tests read them)."""

from __future__ import annotations

import argparse

from services.environment_options import OptionParser
from services.stage_options import add_stage_kind_arguments, stage_parser


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument(
        "--vae-patch-parallel-size",
        type=int,
        default=1,
        help="ranks the rows of each frame are split over, exactly (default: %(default)s)",
    )
    group.add_argument(
        "--vae-use-tiling", action="store_true", help="decode in overlapping tiles on one device (approximate)"
    )
    group.add_argument("--vae-tile-sample-min-height", type=int, default=256, help="tile height in pixels")
    group.add_argument("--vae-tile-sample-min-width", type=int, default=256, help="tile width in pixels")
    group.add_argument("--vae-tile-sample-stride-height", type=int, default=192, help="vertical tile stride")
    group.add_argument("--vae-tile-sample-stride-width", type=int, default=192, help="horizontal tile stride")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_kind_arguments(parser, "vae")
    add_decode_arguments(parser)


def build_parser() -> OptionParser:
    parser = stage_parser("vae")
    add_arguments(parser)
    return parser
