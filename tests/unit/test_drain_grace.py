"""--drain-grace: each stage's calls in flight run on after SIGTERM for its longest call at real size, and the
deployments wait longer than that before they kill a stage (the drain itself: tests/integration/test_stage_drain.py).
"""

from __future__ import annotations

import re

import pytest
import yaml

from services.stage_config import StageConfig
from services.stage_table import STAGES
from tests.helpers.dockerfile import REPOSITORY
from tests.helpers.serving import parse_serve

COMMON_SERVICES = REPOSITORY / "deploy" / "common-services.yml"


def _seconds(period: str) -> float:
    found = re.fullmatch(r"(\d+)(s|m)", period)
    assert found, f"stop_grace_period {period!r}: write it as 90s or 10m"
    return int(found[1]) * (60 if found[2] == "m" else 1)


def test_each_stage_defaults_to_its_own_grace() -> None:
    for name, kind in STAGES.items():
        args = parse_serve([name, "--model", "/models/model"] if kind.reads_checkpoint else [name])
        assert args.drain_grace == kind.drain_grace_s, name
    assert STAGES["dit"].drain_grace_s >= 600, "a real-size DiT call takes minutes"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "90000"])
def test_a_grace_out_of_bounds_is_refused_naming_the_flag(value: str) -> None:
    args = parse_serve(["interp", "--drain-grace", value])
    with pytest.raises(ValueError, match=r"--drain-grace .*: use 0 to 86400 seconds"):
        StageConfig.from_options("interp", args)


def test_compose_waits_longer_than_each_stage_drains() -> None:
    services = yaml.safe_load(COMMON_SERVICES.read_text())["services"]
    env_files = {path.stem: path.read_text() for path in (REPOSITORY / "deploy" / "env").glob("*.env")}
    for name, kind in STAGES.items():
        assert "STAGEDIFF_DRAIN_GRACE" not in env_files.get(name, ""), f"{name}: check its period against it"
        assert _seconds(services[name]["stop_grace_period"]) >= kind.drain_grace_s + 10, name
