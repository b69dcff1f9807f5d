"""The throwaway PostgreSQL and SeaweedFS of `stagediff up --store local-postgres --blobs local-s3` end with the
process that started them, even when it is killed outright (stagediff/local/reaper.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

from stagediff.local.reaper import Cleanup, watch

WAIT_S = 60.0

STARTER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from stagediff.local.servers import postgres, seaweedfs

    with postgres() as database, seaweedfs(Path(sys.argv[1])) as s3:
        print(json.dumps({"postgres": [str(database.directory), database.port], "s3": s3.endpoint}), flush=True)
        time.sleep(600)
    """
)


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_servers_of_a_killed_starter_are_stopped_and_removed(tmp_path: Path) -> None:
    s3_directory = tmp_path / "s3"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(s3_directory)], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert starter.stdout is not None
        servers = json.loads(starter.stdout.readline())
        postgres_directory, postgres_port = Path(servers["postgres"][0]), servers["postgres"][1]
        s3_port = urlsplit(servers["s3"]).port
        assert _answers(postgres_port) and _answers(s3_port) and postgres_directory.exists()
        starter.send_signal(signal.SIGKILL)  # no `finally` runs in the starter
        starter.wait()
        _until(lambda: not _answers(postgres_port), "PostgreSQL still answers")
        _until(lambda: not _answers(s3_port), "SeaweedFS still answers")
        _until(lambda: not postgres_directory.exists() and not s3_directory.exists(), "a directory is left")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def test_a_reaper_told_done_leaves_everything_and_one_left_alone_cleans_up(tmp_path: Path) -> None:
    kept, removed = tmp_path / "kept", tmp_path / "removed"
    kept.mkdir()
    removed.mkdir()
    sleeper = subprocess.Popen(["sleep", "600"])
    marker = tmp_path / "ran"
    try:
        watch(Cleanup(directory=str(kept))).done()
        assert kept.exists()
        reaper = watch(Cleanup(pids=[sleeper.pid], commands=[["touch", str(marker)]], directory=str(removed)))
        assert reaper.process.stdin is not None
        reaper.process.stdin.close()  # as the kernel does when the starter dies
        assert reaper.process.wait(timeout=WAIT_S) == 0
        assert sleeper.wait(timeout=WAIT_S) == -signal.SIGTERM
        assert marker.exists() and not removed.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
