"""A parallel DiT layout the checkpoint cannot run is refused when the stage process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_an_impossible_layout_is_refused_at_startup(tiny_model) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "serve",
            "dit",
            "--model",
            str(tiny_model),
            "--port",
            "0",
            "--ulysses-degree",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    assert "4 attention heads" in completed.stderr and "[1, 2, 4]" in completed.stderr
