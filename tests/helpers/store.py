"""The job store's states, a settable clock, a listing of the store's files, and how tests open a store.

Tests of behaviour every backend shares open their stores with the `open_store` fixture: here the embedded
store (SQLite and the state dir); tests/integration/test_store_conformance.py runs the same tests with
PostgreSQL rows and S3 blobs on real servers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from services.orchestrator.store import (
    JobState,
    JobStore,
)

OpenStore = Callable[..., JobStore]

QUEUED, RUNNING = JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def files(store: JobStore) -> list[str]:
    """Every file the store holds, as `<job_id>/<name>`: in the state dir, and in its blob store if it has one.

    Blob names carry the lease epoch of the claim that wrote them (`e1/result-frames.npy`, `stage-dit.e1.chunks`);
    they are listed without it, as the embedded store names the same files.
    """
    store.files.close()  # a blob store deletes in the background: wait for what is under way (it restarts lazily)
    local = [str(path.relative_to(store.jobs_dir)) for path in store.jobs_dir.rglob("*") if path.is_file()]
    blobs = store.files.blobs
    if blobs is None:
        return sorted(local)
    return sorted(local + [_without_epoch(key) for key in blobs.keys("")])


def _without_epoch(key: str) -> str:
    return re.sub(r"/e\d+/", "/", re.sub(r"\.e\d+\.chunks$", ".chunks", key))


def _key(store: JobStore, job_id: str, name: str) -> str:
    assert store.files.blobs is not None
    found = [key for key in store.files.blobs.keys(f"{job_id}/") if _without_epoch(key) == f"{job_id}/{name}"]
    assert len(found) == 1, (job_id, name, found)
    return found[0]


def read_file(store: JobStore, job_id: str, name: str) -> bytes:
    """A stored file's bytes (as `files` names it), from the state dir or the blob store."""
    if store.files.blobs is None:
        return (store.jobs_dir / job_id / name).read_bytes()
    return store.files.blobs.get(_key(store, job_id, name))


def write_file(store: JobStore, job_id: str, name: str, data: bytes) -> None:
    """Replaces a stored file's bytes behind the store's back (a disk or bucket changed under it)."""
    if store.files.blobs is None:
        (store.jobs_dir / job_id / name).write_bytes(data)
    else:
        store.files.blobs.put(_key(store, job_id, name), data)


def delete_file(store: JobStore, job_id: str, name: str) -> None:
    if store.files.blobs is None:
        (store.jobs_dir / job_id / name).unlink()
    else:
        store.files.blobs.delete(_key(store, job_id, name))


def open_embedded(state_dir: Any, **options: Any) -> JobStore:
    return JobStore.open(state_dir, **options)
