"""The DiT's memory flags that cannot work together are refused when the stage process starts, naming them."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--quantization", "fp4"], ["invalid choice", "fp8", "int8"]),
        (["--quantization", "int8", "--ignored-layers", "no.such.layer"], ["no.such.layer", "matches no linear"]),
        (["--ignored-layers", "proj_out"], ["--ignored-layers needs --quantization"]),
        (["--enable-cpu-offload", "--enable-layerwise-offload"], ["cannot be combined", "choose one"]),
        (["--enable-cpu-offload", "--tensor-parallel-size", "2"], ["cannot be combined", "--tensor-parallel-size"]),
        (["--quantization", "fp8", "--use-hsdp"], ["cannot be combined", "--use-hsdp"]),
    ],
)
def test_bad_memory_flags_are_refused_at_startup(tiny_model, flags, words) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(tiny_model), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    for word in words:
        assert word in completed.stderr, completed.stderr
