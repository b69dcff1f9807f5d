"""A pytest plugin that prints how long each test tier took, at the end of the run.

The tiers are the folders under tests/ (unit, integration, e2e). A tier's time is the sum of its tests'
setup, call and teardown, which in a serial run is its share of the wall time; fixtures shared across tiers
(the session's checkpoints) count where they were first built.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePosixPath

import pytest

TIERS = ("unit", "integration", "e2e")

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


def _tier(nodeid: str) -> str:
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _tier(report.nodeid)
    _seconds[tier] += report.duration
    if report.when == "call":
        _tests[tier] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("time per tier")
    for tier in (*TIERS, "other"):
        if tier in _seconds:
            minutes, seconds = divmod(round(_seconds[tier]), 60)
            terminalreporter.write_line(f"{tier:<12} {_tests[tier]:>5} tests  {minutes:>3}:{seconds:02d}")
