"""A server process's log does not open with torchao's warnings about its compiled extensions (libraries
built for another Python, torch or GPU) or torch's notice about the Enum classes it registers: importing
`services`, as every server process does before its stage's code, drops them (services/library_noise.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.client_only import REPOSITORY


def test_importing_torchao_after_services_logs_nothing() -> None:
    script = "import services, torchao.quantization"  # what transformers imports, where torchao is installed
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == ""
