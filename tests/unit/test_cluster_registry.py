"""The registry of the clusters `stagediff up` runs (stagediff/cluster_registry.py): where it lives, what a live
record is, stale records pruned as they are read, and what `stagediff down` accepts as a cluster's name."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from stagediff.cli import main
from stagediff.cluster_registry import (
    ClusterRecord,
    process_start_ticks,
    register,
    registry_dir,
    running_clusters,
    unregister,
)


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "stagediff" / "clusters"


def _record(state_dir: str = "/tmp/state") -> ClusterRecord:
    return ClusterRecord.of_this_process(
        endpoint="127.0.0.1:50051",
        state_dir=state_dir,
        log_dir="/tmp/logs",
        models=["tiny"],
        http_url="http://127.0.0.1:8000",
    )


def test_the_registry_is_in_the_runtime_dir_else_under_the_state_home() -> None:
    assert registry_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path("/run/user/1000/stagediff/clusters")
    assert registry_dir({"XDG_STATE_HOME": "/s"}) == Path("/s/stagediff/clusters")
    assert registry_dir({}) == Path.home() / ".local" / "state" / "stagediff" / "clusters"


def test_a_registered_cluster_is_listed_until_unregistered(registry: Path) -> None:
    record = _record()
    assert record.start_ticks == process_start_ticks(os.getpid()) is not None
    path = register(record)
    assert path == registry / f"{os.getpid()}.json"
    assert running_clusters() == [record]
    unregister()
    assert running_clusters() == [] and not path.exists()


def test_stale_and_unreadable_records_are_pruned_as_they_are_read(registry: Path) -> None:
    live = _record()
    register(live)
    # The pid of this process, started at another time: the pid of a dead `up`, reused.
    reused = replace(live, pid=os.getppid(), start_ticks=(process_start_ticks(os.getppid()) or 0) + 1)
    register(reused)
    (registry / "99999999.json").write_text("{not json")
    assert running_clusters() == [live]
    assert sorted(path.name for path in registry.iterdir()) == [f"{os.getpid()}.json"]


def test_down_accepts_a_clusters_pid_endpoint_port_or_state_dir(tmp_path: Path) -> None:
    record = replace(_record(str(tmp_path)), endpoint="127.0.0.1:50051,127.0.0.1:50052")
    for target in (str(record.pid), "127.0.0.1:50051,127.0.0.1:50052", "50051", "50052", str(tmp_path)):
        assert record.matches(target), target
    assert not record.matches("50053") and not record.matches(str(tmp_path / "other"))


def test_down_needs_a_cluster_or_all_and_names_one_it_does_not_know(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["down"]) == 2
    assert "name the clusters to stop (see `stagediff ps`), or give --all" in capsys.readouterr().err
    assert main(["down", "50051"]) == 1
    assert capsys.readouterr().err == "stagediff down: no running cluster is 50051 (`stagediff ps` lists them)\n"
    assert main(["down", "--all"]) == 0
    assert capsys.readouterr().out == "no clusters are running\n"


def test_ps_lists_the_running_clusters(registry: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps"]) == 0
    assert capsys.readouterr().out == "no clusters are running (`stagediff up --model DIR` starts one)\n"
    register(_record())
    assert main(["ps"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["PID", "ENDPOINT", "HTTP", "MODELS", "UP", "STATE", "DIR", "LOGS"]
    assert row.split()[:4] == [str(os.getpid()), "127.0.0.1:50051", "http://127.0.0.1:8000", "tiny"]
    assert row.split()[-2:] == ["/tmp/state", "/tmp/logs"]
