"""Cleans up after a throwaway server whose starter ended without doing so (SIGKILL, the OOM killer).

`stagediff up --store local-postgres --blobs local-s3` starts a PostgreSQL (which pg_ctl runs in the background)
and a SeaweedFS; an `up` killed outright runs no `finally`, so both would run on for good, holding their ports,
memory and temporary directories. `watch` starts this module as a small process of its own session (Ctrl-C at the
terminal does not reach it) whose stdin is a pipe from the starter, and the reaper blocks reading it:

- the starter, cleaning up itself as usual, writes `done` and closes the pipe: the reaper exits, doing nothing;
- the starter ends without that word: the kernel closes its end of the pipe, the reaper reads the end of the file
  and cleans up: SIGTERM to each process id (SIGKILL after `GRACE_S`), each command run in turn, the directory
  removed.

Only the standard library is imported here: the reaper starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DONE = b"done"
GRACE_S = 10.0  # how long a process has to end after SIGTERM
COMMAND_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Cleanup:
    """What to undo once the starter is gone: processes to end, commands to run, then a directory to remove."""

    pids: list[int] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    directory: str | None = None


class Reaper:
    """The running reaper of one server; `done()` when the starter has cleaned up after the server itself."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def done(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.write(DONE)
            self.process.stdin.close()
        try:
            self.process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def watch(cleanup: Cleanup) -> Reaper:
    """Starts the reaper of `cleanup`; the pipe's write end stays with this process alone (not inherited)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.local.reaper", json.dumps(asdict(cleanup))],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Reaper(process)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _end(pid: int) -> None:
    """SIGTERM, then SIGKILL past GRACE_S; the process is another's child, so it is polled, not waited for."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.1)


def clean_up(cleanup: Cleanup) -> None:
    for pid in cleanup.pids:
        _end(pid)
    for command in cleanup.commands:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(command, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    if cleanup.directory is not None:
        shutil.rmtree(cleanup.directory, ignore_errors=True)


def main(argv: list[str]) -> int:
    cleanup = Cleanup(**json.loads(argv[0]))
    said = b""
    while chunk := os.read(sys.stdin.fileno(), 64):
        said += chunk
    if said != DONE:
        clean_up(cleanup)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
