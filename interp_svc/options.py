"""The options of `stagediff serve interp` (no torch here: `stagediff up` and the tests read them)."""

from __future__ import annotations

import argparse

from services.environment_options import OptionParser
from services.stage_options import add_stage_kind_arguments, stage_parser


def add_interpolation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interp-model-path", default="", help="RIFE 4.22.lite or 4.25 flownet.pkl (default: optical flow, no weights)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_kind_arguments(parser, "interp")
    add_interpolation_arguments(parser)


def build_parser() -> OptionParser:
    parser = stage_parser("interp")
    add_arguments(parser)
    return parser
