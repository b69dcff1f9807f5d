"""Tenants: the file format and its errors, API keys, per-request size limits and the rate limiter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.tenants import EXAMPLE


def test_check_command_as_a_module(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "services.orchestrator.tenants", "check", str(EXAMPLE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0 and "4 tenant(s): studio, research, free-tier, ops" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: x\n    api_keys: [sd_plain]\n")
    failed = subprocess.run(
        [sys.executable, "-m", "services.orchestrator.tenants", "check", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode == 1 and "tenants[0] (x).api_keys" in failed.stderr and "sd_plain" not in failed.stderr
