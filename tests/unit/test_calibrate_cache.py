"""MagCache's calibration (`stagediff calibrate-cache`) and what the DiT offers from it: the command writes
one ratio per step of each branch into the checkpoint, the DiT then offers `mag` with those ratios, and the
step cache flags a checkpoint cannot honour are refused at startup naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dit_svc.config import DitConfig
from tests.helpers.serving import parse_serve


def test_cache_flags_the_checkpoint_cannot_honour_are_refused(tiny_model: Path, qwen_model: Path, tmp_path) -> None:
    cases = [
        (["--model", str(tiny_model), "--cache-backend", "mag"], "--cache-backend mag: not offered", "calibrate-cache"),
        (["--model", str(qwen_model), "--cache-backend", "teacache"], "--cache-backend teacache", "qwen-image"),
        (["--model", str(tiny_model), "--cache-threshold", "0.1"], "--cache-threshold needs --cache-backend", ""),
        (["--model", str(tiny_model), "--cache-backend", "teacache", "--cache-threshold", "2"], "(0, 1]", ""),
        (["--model", str(tiny_model), "--cache-mag-ratios", str(tmp_path / "none.json")], "no such file", ""),
    ]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"ratios": {"transformer": {"cond": [1.0, float("nan")]}}}))
    cases.append((["--model", str(tiny_model), "--cache-mag-ratios", str(broken)], "ratios.transformer.cond", ""))
    for argv, *words in cases:
        with pytest.raises(SystemExit) as raised:
            DitConfig.from_args(parse_serve(["dit", *argv]))
        for word in words:
            assert word in str(raised.value.code), (argv, raised.value.code)
    # Allowed flags: the offer lists every method the family supports but mag, which needs ratios.
    offer = DitConfig.from_args(
        parse_serve(["dit", "--model", str(tiny_model), "--cache-backend", "teacache"])
    ).step_cache
    assert set(offer.thresholds) == {"first_block", "teacache"} and offer.default.method == "teacache"
