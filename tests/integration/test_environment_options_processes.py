"""`stagediff serve` options from the command line, STAGEDIFF_* variables and a --config file
(services/environment_options.py), in that precedence."""

from __future__ import annotations

import subprocess
import sys


def test_a_real_service_takes_its_parallel_flags_from_the_environment(tiny_model) -> None:
    """The dit service checks its parallel layout against the model before loading: a layout from the
    environment that the model cannot take is refused, naming the flag, like the same flag on the command line."""
    command = [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(tiny_model), "--port", "0"]
    environment = {"STAGEDIFF_ULYSSES_DEGREE": "3", "STAGEDIFF_DEVICE": "cpu", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    assert result.returncode != 0
    assert "ulysses" in result.stderr.lower() and "3" in result.stderr, result.stderr[-2000:]
