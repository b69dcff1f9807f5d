"""The memory guard at stage startup (services/memory_budget.py), at a small scale.

The estimate must equal what the loader really holds, and a stage whose weights do not fit must refuse to start
with one line naming the stage, the bytes needed and available, and a real flag that fixes it. The available
figure is faked through the environment variable the module documents.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.memory_budget import AVAILABLE_ENV
from tests.helpers.serving import run_together

REPO = Path(__file__).resolve().parents[2]


CASES = [
    ("tiny_model", "text-encoder", ["--dtype", "float32"], ["the text-encoder stage", "(text_encoder ", "--dtype"]),
    ("tiny_model", "dit", ["--dtype", "bfloat16"], ["the dit stage", "(transformer ", "fit: --quantization gguf"]),
    ("tiny_model", "dit", ["--ulysses-degree", "2"], ["for 2 processes", "--dtype bfloat16"]),
    ("tiny_model", "vae", ["--vae-patch-parallel-size", "2"], ["the vae stage", "a smaller --vae-patch-parallel"]),
    ("a14b_model", "dit", [], ["(transformer ", ", transformer_2 "]),
    ("qwen_model", "text-encoder", [], ["the text-encoder stage", "(text_encoder "]),
]


@pytest.fixture(scope="module")
def refusals(request: pytest.FixtureRequest) -> list[subprocess.CompletedProcess[str]]:
    """Every case's stage process, started side by side: each refuses after its imports, which the cores share."""
    commands = [
        [sys.executable, "-m", "stagediff.cli", "serve", stage, "--model", str(request.getfixturevalue(model))]
        + ["--port", "0", "--insecure", "--metrics-port", "0", "--device", "cpu", *flags]
        for model, stage, flags, _ in CASES
    ]
    return run_together(commands, timeout=300, cwd=REPO, env={**os.environ, AVAILABLE_ENV: "1000000"})


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{model}-{stage}-{' '.join(flags)}" for model, stage, flags, _ in CASES]
)
def test_a_stage_that_does_not_fit_refuses_to_start_with_the_message(refusals, case: int) -> None:
    completed, (_, stage, _, words) = refusals[case], CASES[case]
    assert completed.returncode != 0
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stagediff serve {stage}: not enough memory to load"), completed.stderr
    assert f"1 MB is available (${AVAILABLE_ENV})" in last, last
    for word in words:
        assert word in last, last
