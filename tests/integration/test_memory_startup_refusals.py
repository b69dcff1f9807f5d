"""The DiT's memory flags that cannot work together are refused when the stage process starts, naming them.

Each case is a stage process that refuses after its imports: they run side by side (one module fixture), so the
cores share their imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.serving import run_together

pytestmark = pytest.mark.e2e

CASES = [
    (["--quantization", "fp4"], ["invalid choice", "fp8", "int8"]),
    (["--quantization", "int8", "--ignored-layers", "no.such.layer"], ["no.such.layer", "matches no linear"]),
    (["--ignored-layers", "proj_out"], ["--ignored-layers needs --quantization"]),
    (["--enable-cpu-offload", "--enable-layerwise-offload"], ["cannot be combined", "choose one"]),
    (["--enable-cpu-offload", "--tensor-parallel-size", "2"], ["cannot be combined", "--tensor-parallel-size"]),
    (["--quantization", "fp8", "--use-hsdp"], ["cannot be combined", "--use-hsdp"]),
]


@pytest.fixture(scope="module")
def refusals(tiny_model: Path) -> list[subprocess.CompletedProcess[str]]:
    serve = [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(tiny_model), "--port", "0"]
    return run_together([[*serve, *flags] for flags, _ in CASES], timeout=300)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(flags) for flags, _ in CASES])
def test_bad_memory_flags_are_refused_at_startup(refusals, case: int) -> None:
    completed, (_, words) = refusals[case], CASES[case]
    assert completed.returncode != 0
    for word in words:
        assert word in completed.stderr, completed.stderr
