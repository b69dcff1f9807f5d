"""How tests start and parse stages: the thread count per stage process, `stagediff serve` argument parsing, and
stage processes run side by side."""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

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


def run_together(
    commands: list[list[str]], *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Runs `commands` at once and returns how each ended, in order: for stage processes that are expected to
    refuse at startup, whose seconds go to imports, so that the machine's cores share them."""
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
        for command in commands
    ]
    finished = []
    try:
        for command, process in zip(commands, processes, strict=True):
            stdout, stderr = process.communicate(timeout=timeout)
            finished.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return finished
