"""The memory guard through `stagediff up`: the local cluster names the stage that does not fit, with the
guard's line from its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.memory_budget import (
    AVAILABLE_ENV,
)


def test_the_local_cluster_reports_the_guard_of_a_stage_that_does_not_fit(tiny_model: Path, tmp_path: Path) -> None:
    """`stagediff up` (LocalCluster) names the stage that exited, with the guard's line from its log."""
    from stagediff.local.supervisor import LocalCluster

    cluster = LocalCluster(tiny_model, threads_per_stage=1, log_dir=tmp_path / "logs", env={AVAILABLE_ENV: "1000000"})
    with pytest.raises(RuntimeError) as failed:
        cluster.start(timeout=120)
    cluster.stop()
    message = str(failed.value)
    assert "before it was SERVING" in message, message
    assert "not enough memory to load the" in message and f"1 MB is available (${AVAILABLE_ENV})" in message, message
