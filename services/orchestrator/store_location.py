"""Where the orchestrator keeps its jobs and files: `--store` and `--blobs`, read once into typed locations.

`--store` is a `postgresql://` URL (the default, SQLite in the state directory, serves one replica);
`--blobs` is a directory (the default: the state directory's own) or `s3://BUCKET[/PREFIX]`, with the
endpoint of an S3-compatible store in `--blobs-endpoint` and the keys from the environment or the files
boto3 reads (never from a flag: they would show in the process list). A password in a PostgreSQL URL is
refused for the same reason: use PGPASSWORD or a `~/.pgpass` file.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from services.orchestrator.blobs.local import LocalBlobs
from services.orchestrator.blobs.protocol import BlobStore, check_prefix
from services.orchestrator.blobs.s3 import CHECKSUM_MODES, S3Blobs, s3_client
from services.orchestrator.store.jobstore import EMBEDDED_OWNER
from services.orchestrator.store_errors import StoreError

_BUCKET_CHARACTERS = set("abcdefghijklmnopqrstuvwxyz0123456789.-")


@dataclass(frozen=True)
class SqliteLocation:
    directory: Path


@dataclass(frozen=True)
class PostgresLocation:
    dsn: str


@dataclass(frozen=True)
class LocalBlobsLocation:
    directory: Path


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str
    endpoint: str | None
    checksums: str


def store_location(value: str) -> SqliteLocation | PostgresLocation:
    """`--store`: ValueError naming the flag and what is allowed."""
    if value.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(value)
        if parts.password:
            raise ValueError("--store: give the password in PGPASSWORD or ~/.pgpass, not in the URL")
        if not parts.hostname:
            raise ValueError("--store: a postgresql:// URL names its host (postgresql://USER@HOST:PORT/DATABASE)")
        return PostgresLocation(value)
    raise ValueError(
        f"--store '{value[:64]}': use a postgresql:// URL (without --store, the job records are SQLite in --state-dir)"
    )


def blobs_location(
    value: str, *, endpoint: str | None = None, checksums: str = "when_required"
) -> LocalBlobsLocation | S3Location:
    """`--blobs` (with `--blobs-endpoint` and `--blobs-checksums`): ValueError naming the flag."""
    if checksums not in CHECKSUM_MODES:
        raise ValueError(f"--blobs-checksums '{checksums}': use one of {', '.join(CHECKSUM_MODES)}")
    if value.startswith("s3://"):
        parts = urlsplit(value)
        bucket = parts.netloc
        if not 3 <= len(bucket) <= 63 or not set(bucket) <= _BUCKET_CHARACTERS:
            raise ValueError(f"--blobs '{value}': the bucket is 3 to 63 lowercase letters, digits, '.' and '-'")
        if parts.query or parts.fragment:
            raise ValueError("--blobs: s3://BUCKET[/PREFIX] takes no query; the endpoint goes in --blobs-endpoint")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_prefix(prefix + "/")
            except ValueError as error:
                raise ValueError(f"--blobs '{value}': the prefix's {error}") from None
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--blobs-endpoint '{endpoint}': use http://HOST:PORT or https://HOST:PORT")
        return S3Location(bucket, prefix + "/" if prefix else "", endpoint, checksums)
    if "://" in value:
        raise ValueError(f"--blobs '{value.split('://')[0]}://...': use a directory or s3://BUCKET[/PREFIX]")
    if endpoint is not None:
        raise ValueError("--blobs-endpoint: only with --blobs s3://...")
    return LocalBlobsLocation(Path(value))


def open_blobs(location: LocalBlobsLocation | S3Location | None) -> BlobStore | None:
    """The blob store `--blobs` names; None for the default (files in the state directory)."""
    if location is None:
        return None
    if isinstance(location, LocalBlobsLocation):
        return LocalBlobs(location.directory)
    client = s3_client(location.endpoint, None, None, checksums=location.checksums)
    blobs = S3Blobs(client, location.bucket, location.prefix)
    try:
        blobs.size("stagediff-reachability-check")  # fails now, not at the first job, on a wrong bucket or key
    except Exception as error:
        raise StoreError(f"--blobs s3://{location.bucket}: the store cannot be used: {error}") from None
    return blobs


def replica_owner(store: SqliteLocation | PostgresLocation) -> str:
    """The name this process's claims carry: unique per process with a shared database."""
    if isinstance(store, SqliteLocation):
        return EMBEDDED_OWNER
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"
