"""Replicated orchestrators: the time from a leader's SIGKILL to the next admission, and what PostgreSQL and S3
cost per job against SQLite and local files, at one and two replicas, side by side in one run.

One set of stages (the tiny preset) serves three control planes at once:
  sqlite     one orchestrator on SQLite and its state directory (the embedded default)
  shared-1   one orchestrator on PostgreSQL and S3 (SeaweedFS)
  shared-2   two orchestrators on another PostgreSQL database and bucket prefix, each job sent to the leader
  relayed    the same two, each job sent to the follower (which relays it to the leader)
Jobs go to the planes in turn, one at a time (each round in another order, so that no plane always follows
the same one), and each one's end-to-end time is measured from the client (`generate`: admission, the stages,
the result's upload and commit, every frame back). The overhead of a plane is the median over rounds of its
job's time over the sqlite job's of the same round. Every process's CPU time is read from /proc around each
job and summed by role (orchestrators, stages, PostgreSQL, SeaweedFS), since on one machine the servers' CPU
competes with the stages for the same cores. Then the leader of shared-2 is SIGKILLed `--kills` times while a
client submits through the SDK with both addresses: the time from the kill to the first accepted admission is
the takeover. Real servers: Debian's PostgreSQL, SeaweedFS. Prints one JSON object.

    python bench/failover.py --jobs 20 --kills 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from services.auth import CLUSTER_SECRET_ENV
from stagediff import Client
from stagediff.client import RetryPolicy
from stagediff.local.launch import free_ports
from stagediff.local.servers import S3Server, postgres, seaweedfs
from stagediff.local.supervisor import LocalCluster

HOST = "127.0.0.1"
PROMPT = "a red fox running through fresh snow"


class Orchestrator:
    """One `stagediff serve orchestrator` process in front of the shared stages."""

    def __init__(self, name: str, stages: dict[str, str], workdir: Path, secret: str, storage: list[str]) -> None:
        self.name = name
        self.port = free_ports(1, HOST)[0]
        self.endpoint = f"{HOST}:{self.port}"
        self.args = [
            sys.executable, "-m", "stagediff.cli", "serve", "orchestrator", "--host", HOST, "--port", str(self.port),
            *(item for stage, endpoint in stages.items() for item in (f"--{stage}", endpoint)),
            "--state-dir", str(workdir / name), "--advertise", self.endpoint, *storage,
        ]  # fmt: skip
        self.environment = {**os.environ, CLUSTER_SECRET_ENV: secret}
        self.log = workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> Orchestrator:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env={**self.environment, **env}, start_new_session=True
            )
        deadline = time.monotonic() + 120
        with Client(self.endpoint, retry=RetryPolicy(max_attempts=1)) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.log}")
                try:
                    if client.health() == "SERVING":
                        return self
                except Exception:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not serve within 120 s; see {self.log}")

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def _leader(dsn: str, replicas: list[Orchestrator]) -> Orchestrator | None:
    with psycopg.connect(dsn) as connection:
        row = connection.execute(
            "SELECT replicas.endpoint FROM leader JOIN replicas ON replicas.replica_id = leader.leader_id"
            " WHERE leader.expires_at > now()"
        ).fetchone()
    return next((replica for replica in replicas if row is not None and replica.endpoint == row[0]), None)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids_named(name: str) -> list[int]:
    """The processes whose command name is `name` (PostgreSQL's server processes are all `postgres`)."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name:
                found.append(int(comm.parent.name))
        except OSError:
            continue
    return found


class CpuByRole:
    """The CPU seconds of each role's processes, read before and after a job."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles

    def read(self) -> dict[str, float]:
        return {role: sum(_cpu_seconds(pid) for pid in pids) for role, pids in self.roles.items()}


def _paired_ratio(times: list[float], baseline: list[float]) -> float:
    """The median over rounds of a plane's job time over the baseline's in the same round."""
    return statistics.median([a / b for a, b in zip(times, baseline, strict=True)])


def _storage(dsn: str, s3: S3Server, prefix: str) -> list[str]:
    return ["--store", dsn, "--blobs", f"s3://{s3.bucket}/{prefix}", "--blobs-endpoint", s3.endpoint]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="jobs per control plane")
    parser.add_argument("--kills", type=int, default=3, help="leader SIGKILLs")
    parser.add_argument("--model", help="existing tiny checkpoint (default: make one with init-model)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-bench-failover-"))
    model = Path(args.model) if args.model else init_model("wan-t2v", "tiny", workdir / "tiny")
    request = dict(DEFAULT_REQUESTS["tiny"])
    cluster = LocalCluster(model, threads_per_stage=1, log_dir=workdir / "logs", state_dir=workdir / "sqlite")
    cluster.start(timeout=600)
    replicas: list[Orchestrator] = []
    try:
        with postgres() as server, seaweedfs(workdir / "seaweedfs") as s3:
            s3_env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
            stages = {
                name: service.endpoint
                for name, service in cluster.services.items()
                if name in ("text-encoder", "dit", "vae", "interp")
            }
            one_dsn, two_dsn = server.new_database(), server.new_database()
            shared_1 = Orchestrator("shared-1", stages, workdir, cluster.cluster_secret, _storage(one_dsn, s3, "one"))
            pair = [
                Orchestrator(f"shared-2-{n}", stages, workdir, cluster.cluster_secret, _storage(two_dsn, s3, "two"))
                for n in (1, 2)
            ]
            replicas = [shared_1, *pair]
            for replica in replicas:
                replica.start(s3_env)
            leader = None
            while leader is None:
                leader = _leader(two_dsn, pair)
                time.sleep(0.2)
            follower = next(replica for replica in pair if replica is not leader)
            planes = {
                "sqlite": cluster.endpoint,
                "shared-1": shared_1.endpoint,
                "shared-2": leader.endpoint,
                "relayed": follower.endpoint,
            }
            seconds: dict[str, list[float]] = {name: [] for name in planes}
            cpu: dict[str, dict[str, float]] = {name: {} for name in planes}
            clients = {name: Client(endpoint) for name, endpoint in planes.items()}
            stage_pids = [service.pid for name, service in cluster.services.items() if name in stages]
            roles = CpuByRole(
                {
                    "orchestrators": [cluster.services["orchestrator"].pid]
                    + [replica.process.pid for replica in replicas if replica.process is not None],
                    "stages": stage_pids,
                    "postgresql": _pids_named("postgres"),
                    "seaweedfs": _pids_named("weed"),
                }
            )
            order = list(clients)
            try:
                for client in clients.values():  # warm: first-call allocations, connections, lazy imports
                    client.generate(PROMPT, seed=0, **request)
                for job in range(args.jobs):
                    for name in order[job % len(order) :] + order[: job % len(order)]:
                        before = roles.read()
                        started = time.perf_counter()
                        clients[name].generate(PROMPT, seed=job + 1, **request)
                        seconds[name].append(time.perf_counter() - started)
                        for role, used in roles.read().items():
                            cpu[name][role] = cpu[name].get(role, 0.0) + used - before[role]
            finally:
                for client in clients.values():
                    client.close()

            takeovers = []
            for kill in range(args.kills):
                leader = _leader(two_dsn, pair)
                assert leader is not None
                with Client(",".join(replica.endpoint for replica in pair)) as client:
                    leader.kill()
                    killed = time.perf_counter()
                    client.submit(PROMPT, seed=1000 + kill, **request)
                    takeovers.append(time.perf_counter() - killed)
                leader.start(s3_env)  # back as a follower, for the next round
    finally:
        for replica in replicas:
            replica.stop()
        cluster.stop()

    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        json.dumps(
            {
                "benchmark": "failover",
                "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                "preset": "tiny",
                "jobs_per_plane": args.jobs,
                "job_seconds_median": {name: round(value, 4) for name, value in medians.items()},
                "job_seconds_all": {name: [round(v, 4) for v in values] for name, values in seconds.items()},
                "overhead_vs_sqlite": {
                    name: round(medians[name] / medians["sqlite"] - 1.0, 4)
                    for name in ("shared-1", "shared-2", "relayed")
                },
                "overhead_vs_sqlite_paired": {
                    name: round(_paired_ratio(seconds[name], seconds["sqlite"]) - 1.0, 4)
                    for name in ("shared-1", "shared-2", "relayed")
                },
                "cpu_ms_per_job": {
                    name: {role: round(used / args.jobs * 1000, 1) for role, used in roles_used.items()}
                    for name, roles_used in cpu.items()
                },
                "takeover_seconds": [round(value, 2) for value in takeovers],
                "takeover_seconds_max": round(max(takeovers), 2) if takeovers else None,
                "leader_lease_s": 6.0,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
