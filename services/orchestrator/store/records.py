"""The values the job store keeps: a job as stored, the input images saved for it, a tenant's bytes.

They are plain values, the same whichever database holds the rows and wherever the files lie.
`record_from_row` maps a row of the jobs table (anything indexed by column name) to a `JobRecord`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.orchestrator import notices as job_notices
from stagediff.v1 import generation_pb2, stages_pb2

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)
ACTIVE_STATES = (JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING)

# The intermediates row (and file name part) of a job's input images, never a stage's name: the job's row holds
# their digests, the file their bytes, which count in the tenant's bytes like any intermediate until the stages
# that encode them are done (`drop_input_images`) or the job ends.
INPUT_IMAGES = "input-images"


class Row(Protocol):
    """A database row read by column name."""

    def __getitem__(self, key: str, /) -> Any: ...


@dataclass
class JobRecord:
    """One job as stored. `seq` (admission order) is assigned by `insert`."""

    job_id: str
    tenant: str
    request: bytes  # a serialized GenerateRequest with every default filled in
    request_id: str = ""
    priority: str = "normal"
    state: int = JobState.JOB_STATE_QUEUED
    created_at: float = 0.0  # 0: the store's clock at insert
    started_at: float | None = None
    finished_at: float | None = None
    deadline_at: float | None = None  # unix seconds; jobs past it are failed on recovery
    error_code: int | None = None
    error_message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    num_frames_out: int = 0
    fps_out: float = 0.0
    last_stage: str = ""
    attempts: int = 0
    owner: str = ""  # the replica running the job; "" while queued
    lease_epoch: int = 0  # +1 per claim: the fencing token of the owner's writes
    passes_run: int = 0
    passes_skipped: int = 0
    # The changes made to the request that its caller did not ask for (services/orchestrator/notices.py).
    notices: list[stages_pb2.Notice] = field(default_factory=list)
    seq: int = 0
    # Times the job yielded its DiT slot to a job of a higher class.
    preemptions: int = 0

    @classmethod
    def new(
        cls,
        job_id: str,
        tenant: str,
        request: generation_pb2.GenerateRequest,
        *,
        priority: str = "normal",
        deadline_at: float | None = None,
        notices: Iterable[stages_pb2.Notice] = (),
    ) -> JobRecord:
        return cls(
            job_id=job_id,
            tenant=tenant,
            request=request.SerializeToString(deterministic=True),
            request_id=request.request_id,
            priority=priority,
            deadline_at=deadline_at,
            notices=list(notices),
        )

    def parse_request(self) -> generation_pb2.GenerateRequest:
        request: generation_pb2.GenerateRequest = generation_pb2.GenerateRequest.FromString(self.request)
        return request

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class SavedImages:
    """The file `save_input_images` wrote in a job's folder, and its size."""

    file: str
    size: int


@dataclass(frozen=True)
class Usage:
    """Bytes a tenant's jobs hold in the state directory."""

    finished: int  # results of its finished jobs: what `prune` may delete
    active: int  # intermediates (and committed results) of its queued and running jobs

    @property
    def total(self) -> int:
        return self.finished + self.active


def record_from_row(row: Row) -> JobRecord:
    """The job a row of the jobs table describes."""
    return JobRecord(
        job_id=row["job_id"],
        tenant=row["tenant"],
        request=bytes(row["request"]),
        request_id=row["request_id"] or "",
        priority=row["priority"],
        state=row["state"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        deadline_at=row["deadline_at"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        timings=json.loads(row["timings"]),
        num_frames_out=row["num_frames_out"],
        fps_out=row["fps_out"],
        last_stage=row["last_stage"],
        attempts=row["attempts"],
        owner=row["owner"],
        lease_epoch=row["lease_epoch"],
        passes_run=row["passes_run"],
        passes_skipped=row["passes_skipped"],
        notices=job_notices.from_json(row["notices"]),
        seq=row["seq"],
        preemptions=row["preemptions"],
    )
