"""The job store's states, a settable clock and a listing of the store's files."""

from __future__ import annotations

from services.orchestrator.store import (
    JobState,
    JobStore,
)

QUEUED, RUNNING = JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def files(store: JobStore) -> list[str]:
    return sorted(str(path.relative_to(store.jobs_dir)) for path in store.jobs_dir.rglob("*") if path.is_file())
