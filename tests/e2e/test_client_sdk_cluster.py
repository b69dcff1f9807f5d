"""The CLI's `generate` against the shared local cluster, from a process that cannot import torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stagediff.media import read_video_frames
from tests.helpers.client_only import REPOSITORY, client_only_environment


@pytest.mark.e2e
def test_generate_writes_an_mp4_from_a_process_that_cannot_import_torch(cluster, tmp_path: Path) -> None:
    """`stagediff generate` as a plain install runs it: torch, the server packages and opentelemetry are not
    importable in its process."""
    env = client_only_environment(tmp_path / "client-only")
    out = tmp_path / "fox.mp4"
    command = [
        sys.executable, "-m", "stagediff.cli", "generate", "--endpoint", cluster.endpoint, "--prompt", "a red fox",
        "--height", "64", "--width", "64", "--frames", "9", "--steps", "2", "--seed", "3", "--quiet", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out) and summary["frames"] == 9
    assert read_video_frames(out).shape == (9, 64, 64, 3)
