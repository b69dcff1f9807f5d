"""The options of `stagediff serve text-encoder` (no torch here: `stagediff up` and the tests read them)."""

from __future__ import annotations

import argparse

from services.environment_options import OptionParser
from services.stage_options import add_stage_kind_arguments, stage_parser
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--embedding-cache-bytes",
        type=int,
        default=DEFAULT_CACHE_BYTES,
        help="bytes of embeddings kept in the LRU cache; 0 disables it (default: %(default)s, 256 MiB)",
    )
    parser.add_argument(
        "--embedding-cache-size",
        type=int,
        default=DEFAULT_CACHE_ENTRIES,
        help="texts kept in the LRU cache, within --embedding-cache-bytes; 0 disables it (default: %(default)s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_kind_arguments(parser, "text-encoder")
    add_cache_arguments(parser)


def build_parser() -> OptionParser:
    parser = stage_parser("text-encoder")
    add_arguments(parser)
    return parser
