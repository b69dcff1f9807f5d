"""The DiT's memory flags that cannot work together are refused when the stage starts, naming them.

Every refusal is made by the parser or by `DitConfig.from_args`, before anything loads: the cases run there in
this process, and two stage processes (one refused by the parser, one by the config) show the refusal reaching
the command line's stderr with a failing exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dit_svc.config import DitConfig
from tests.helpers.serving import parse_serve, run_together

pytestmark = pytest.mark.e2e

# Refused by the parser (an invalid choice): a process's stderr only.
PARSER_CASE = (["--quantization", "fp4"], ["invalid choice", "fp8", "int8"])
CASES = [
    (["--quantization", "int8", "--ignored-layers", "no.such.layer"], ["no.such.layer", "matches no linear"]),
    (["--ignored-layers", "proj_out"], ["--ignored-layers needs --quantization"]),
    (["--enable-cpu-offload", "--enable-layerwise-offload"], ["cannot be combined", "choose one"]),
    (["--enable-cpu-offload", "--tensor-parallel-size", "2"], ["cannot be combined", "--tensor-parallel-size"]),
    (["--quantization", "fp8", "--use-hsdp"], ["cannot be combined", "--use-hsdp"]),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(flags) for flags, _ in CASES])
def test_bad_memory_flags_are_refused_before_the_stage_loads(tiny_model: Path, case: int) -> None:
    flags, words = CASES[case]
    with pytest.raises(SystemExit) as refused:
        DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model), *flags]))
    for word in words:
        assert word in str(refused.value), refused.value


def test_a_refusing_stage_process_prints_why_and_fails(tiny_model: Path) -> None:
    serve = [sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(tiny_model), "--port", "0"]
    cases = [PARSER_CASE, CASES[2]]
    finished: list[subprocess.CompletedProcess[str]] = run_together(
        [[*serve, *flags] for flags, _ in cases], timeout=300
    )
    for completed, (flags, words) in zip(finished, cases, strict=True):
        assert completed.returncode != 0, flags
        for word in words:
            assert word in completed.stderr, completed.stderr
