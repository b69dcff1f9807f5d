"""How tests start and parse stages: the thread count per stage process and `stagediff serve` argument parsing."""

from __future__ import annotations

import argparse
import shlex

import pytest

from services.environment_options import options_module, parse_args
from services.stage_table import SERVE_TARGETS

# One thread per stage process: the machine has few cores and five processes share them.
THREADS_PER_STAGE = 1


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """`stagediff serve <stage> ...` parsed as its main() parses it: by the stage's own parser, over the STAGEDIFF_*
    environment (services/environment_options.py)."""
    assert argv and argv[0] in SERVE_TARGETS, f"not a serve target: {argv[:1]}"
    try:
        return parse_args(options_module(argv[0]).build_parser(), argv[1:])
    except SystemExit as error:
        pytest.fail(f"stagediff serve {shlex.join(argv)}: rejected by its parser (exit {error.code})")
