"""The clusters `stagediff up` runs on this machine, and `stagediff ps` and `stagediff down`, which list and stop them.

A running `up` records itself, once ready, as one small JSON file per cluster (`<pid>.json`: its pid and process
start time, endpoints, state dir, models and log dir) in `registry_dir()`: `$XDG_RUNTIME_DIR/stagediff/clusters`,
else `$XDG_STATE_HOME/stagediff/clusters` (`~/.local/state/...`), private to the user. `up` removes its file as
it exits cleanly; one killed outright leaves it behind, so every reader checks that the process is still that
`up`: its pid alive and, on Linux, the start time in /proc/<pid>/stat unchanged (a reused pid has another). A
stale file is removed as it is read.

`stagediff down` sends SIGTERM to `up`, which stops its services in order, and waits, bounded, for it to exit.

A client module: imports nothing of the servers', no torch, no gRPC; `stagediff/local/up.py` writes with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REGISTRY_SUBDIR = Path("stagediff") / "clusters"
DOWN_TIMEOUT_S = 90.0  # `up` stops its services in waves, each within a 15 s grace
POLL_S = 0.2


@dataclass(frozen=True)
class ClusterRecord:
    """One running `stagediff up`, as its registry file holds it."""

    pid: int
    endpoint: str
    state_dir: str
    log_dir: str
    models: list[str] = field(default_factory=list)
    http_url: str | None = None
    started_at: float = 0.0
    """Wall-clock seconds since the epoch."""
    start_ticks: int | None = None
    """The process's start time in /proc/<pid>/stat (clock ticks since boot); None where there is no /proc."""

    @classmethod
    def of_this_process(
        cls, endpoint: str, state_dir: str, log_dir: str, models: list[str], http_url: str | None
    ) -> ClusterRecord:
        """The record of the calling process (`up` itself) serving a cluster at `endpoint`."""
        pid = os.getpid()
        return cls(pid, endpoint, state_dir, log_dir, models, http_url, time.time(), process_start_ticks(pid))

    def is_running(self) -> bool:
        """Whether the process that wrote this record still runs (not a reuse of its pid, not a zombie)."""
        if self.start_ticks is not None and Path("/proc").is_dir():
            return process_start_ticks(self.pid) == self.start_ticks
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def matches(self, target: str) -> bool:
        """Whether `target` (`stagediff down TARGET`) names this cluster: its pid, its endpoint, the endpoint's
        port, or its state dir."""
        ports = [address.rpartition(":")[2] for address in self.endpoint.split(",")]
        return target in (str(self.pid), self.endpoint, *ports, self.state_dir) or _same_path(target, self.state_dir)


def registry_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where this user's running clusters are recorded (see the module docstring)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / REGISTRY_SUBDIR
    state = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / REGISTRY_SUBDIR


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (the start time), None where the process is gone, a zombie, or there is no
    /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def register(record: ClusterRecord, directory: Path | None = None) -> Path:
    """Writes `record` (atomically) and returns its file."""
    directory = directory or registry_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{record.pid}.json"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(record), indent=2) + "\n")
    os.replace(temporary, path)
    return path


def unregister(pid: int | None = None, directory: Path | None = None) -> None:
    """Removes the record of `pid` (default: this process)."""
    path = (directory or registry_dir()) / f"{os.getpid() if pid is None else pid}.json"
    path.unlink(missing_ok=True)


def running_clusters(directory: Path | None = None) -> list[ClusterRecord]:
    """The recorded clusters whose `up` still runs, oldest first; stale and unreadable records are removed."""
    directory = directory or registry_dir()
    clusters = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        record = _read(path)
        if record is None or not record.is_running():
            path.unlink(missing_ok=True)
            continue
        clusters.append(record)
    return sorted(clusters, key=lambda record: record.started_at)


def stop_cluster(record: ClusterRecord, timeout: float = DOWN_TIMEOUT_S) -> bool:
    """SIGTERM to the cluster's `up`, then waits up to `timeout` seconds for it to exit; whether it did."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while record.is_running():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _read(path: Path) -> ClusterRecord | None:
    try:
        data = json.loads(path.read_text())
        return ClusterRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


# -- the commands -----------------------------------------------------------------------------------------------


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """`stagediff ps` and `stagediff down`."""
    ps = commands.add_parser(
        "ps",
        help="list the clusters `stagediff up` runs on this machine",
        description="Lists the clusters that `stagediff up` runs on this machine for this user, once they are "
        f"ready (recorded in {registry_dir()}).",
    )
    ps.add_argument("--json", action="store_true", help="one JSON object per cluster, one per line")
    ps.set_defaults(func=_ps)
    down = commands.add_parser(
        "down",
        help="stop clusters that `stagediff up` runs on this machine",
        description="Sends SIGTERM to the `stagediff up` of each cluster named (or of every one with --all) and "
        "waits for it to stop its services and exit.",
    )
    down.add_argument(
        "targets", nargs="*", metavar="CLUSTER", help="a cluster's pid, endpoint HOST:PORT, port or state dir"
    )
    down.add_argument("--all", action="store_true", help="stop every cluster `stagediff ps` lists")
    down.add_argument(
        "--timeout",
        type=float,
        default=DOWN_TIMEOUT_S,
        help="seconds to wait for each cluster to exit (default: %(default)s)",
    )
    down.set_defaults(func=_down)


def _ps(args: argparse.Namespace) -> int:
    clusters = running_clusters()
    if args.json:
        for record in clusters:
            print(json.dumps(asdict(record)))
        return 0
    if not clusters:
        print("no clusters are running (`stagediff up --model DIR` starts one)")
        return 0
    rows = [("PID", "ENDPOINT", "HTTP", "MODELS", "UP", "STATE DIR", "LOGS")]
    for record in clusters:
        rows.append(
            (
                str(record.pid),
                record.endpoint,
                record.http_url or "-",
                ",".join(record.models) or "-",
                _age(time.time() - record.started_at),
                record.state_dir,
                record.log_dir,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _down(args: argparse.Namespace) -> int:
    if args.all == bool(args.targets):
        print("stagediff down: name the clusters to stop (see `stagediff ps`), or give --all", file=sys.stderr)
        return 2
    clusters = running_clusters()
    chosen = clusters if args.all else [record for record in clusters if any(map(record.matches, args.targets))]
    unknown = [target for target in args.targets if not any(record.matches(target) for record in clusters)]
    for target in unknown:
        print(f"stagediff down: no running cluster is {target} (`stagediff ps` lists them)", file=sys.stderr)
    failed = 0
    for record in chosen:
        if stop_cluster(record, args.timeout):
            print(f"stopped the cluster at {record.endpoint} (pid {record.pid})")
        else:
            failed += 1
            print(
                f"stagediff down: the cluster at {record.endpoint} (pid {record.pid}) is still stopping after "
                f"{args.timeout:g} s; `kill -9 {record.pid}` ends it now, and its services with it",
                file=sys.stderr,
            )
    if args.all and not chosen:
        print("no clusters are running")
    return 1 if failed or unknown else 0


def _age(seconds: float) -> str:
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
