"""bench/hostile.py's short form: refused oversized requests must not grow the orchestrator past the target.

A later change that lets the public port take large messages again (the first hostile pass brought 24
refused 16 MiB requests from +1,067 MiB to +0.6 MiB; raising the message limit for images reopened it
unseen) fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_refused_oversized_requests_stay_within_the_memory_target(tmp_path: Path) -> None:
    command = [sys.executable, str(REPOSITORY / "bench" / "hostile.py"), "--scenarios", "refused", "--refused", "24"]
    command += ["--family", "wan-t2v", "--settle-s", "1", "--tree-timeout", "400"]
    finished = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-4000:]
    output = json.loads(finished.stdout)
    refused = output["result"]["refused_24"]
    assert refused["requests"] == 24 and "OK" not in refused["codes"], refused
    row = output["targets"]["refused_24_delta_mib"]
    assert row["meets"], (
        f"24 refused 16 MiB requests grew the orchestrator by {row['value']} MiB (target {row['target']})"
    )
