"""What can go wrong with the job store, and how failed file and database operations map to it.

Every failure is a `StoreError` with a one-line message; running out of space
(ENOSPC, EDQUOT, SQLite's SQLITE_FULL) is the subclass `StoreFull`, which the
orchestrator answers with RESOURCE_EXHAUSTED rather than INTERNAL.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StoreError(Exception):
    """The state directory cannot be used as asked."""


class StoreFull(StoreError):
    """The state directory's volume (or the database in it) is out of space."""


class StateDirLocked(StoreError):
    """Another process owns the state directory."""


class UnknownJob(KeyError):
    """No record with that job id."""


class InvalidTransition(StoreError):
    """The job's current state does not allow the change (e.g. it already finished)."""


class StoreUnavailable(StoreError):
    """The job database cannot be reached now (restarting, failing over, cut off): worth retrying."""


class LeaseLost(InvalidTransition):
    """Another replica claimed the job since this one did: this replica's writes of it change nothing."""


class ResultGone(StoreError):
    """A result's file is no longer there: the job failed before it was complete, or it was deleted."""


class DuplicateRequestId(StoreError):
    """The tenant already has a job with this request id; `job_id` names it."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


def io_error(error: OSError, what: str, *, with_path: bool = False) -> StoreError:
    """A one-line StoreError (StoreFull when out of space) for a failed file operation.

    Job-level messages may reach clients, so they name no server path; `with_path` is for the operator's.
    """
    kind = StoreFull if error.errno in OUT_OF_SPACE else StoreError
    where = f" ({error.filename})" if with_path and error.filename else ""
    return kind(f"{what}: {error.strerror or error}{where}")


# The S3 client's errors for a store it cannot reach (botocore's names), as opposed to one that refused a call.
_UNREACHABLE = frozenset(
    {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"}
)


def blob_error(error: Exception, what: str) -> StoreError:
    """A one-line StoreError for a failed blob store call (the message names the key, never a URL or secret);
    StoreUnavailable when the store could not be reached."""
    if isinstance(error, StoreError):
        return error
    detail = str(error) if isinstance(error, RuntimeError) else type(error).__name__
    unreachable = isinstance(error, ConnectionError | TimeoutError) or type(error).__name__ in _UNREACHABLE
    kind = StoreUnavailable if unreachable else StoreError
    return kind(f"{what}: the blob store {'cannot be reached' if unreachable else 'failed'}: {detail}")


def db_error(error: sqlite3.Error) -> StoreError:
    code = getattr(error, "sqlite_errorcode", None)
    kind = StoreFull if code is not None and code & 0xFF == sqlite3.SQLITE_FULL else StoreError
    return kind(f"the job database failed: {error}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
