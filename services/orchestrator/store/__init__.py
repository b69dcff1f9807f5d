"""Durable job records and their files under the orchestrator's state directory.

Layout of `state_dir`: jobs.sqlite3 (+ -wal, -shm) holds the job records, which intermediates and results
exist and their sizes; LOCK is held (flock) by the one process that owns the directory; jobs/<job_id>/ holds
each job's files (see files.py).

    jobstore.py     JobStore: every operation, composing the rows and the files, and their guarantees
    job_results.py  its result operations: a result's files made, committed with its row, loaded back
    rows.py         the SQL of each operation on the jobs, intermediates and results tables
    schema.py       the tables and the migrations from older state directories
    database.py     the connection, transactions and the state directory's lock
    files.py        the jobs' files: stage outputs, input images; atomic writes; name checks; the sweep
    results.py      a result's files: the spool of a running job's result, completed all or none, found again
    retention.py    a tenant's bytes, and which finished jobs `prune` deletes
    records.py      JobRecord, SavedImages, Usage, and a row as a JobRecord

Rows know no file and files know no row: they meet only in JobStore, by (job_id, file name). The errors, and
how OS and SQLite failures map to them, are in store_errors.py; the result file formats and readers in
result_files.py, their writers in result_writers.py, a committed result (StoredResult) in stored_result.py.
Callers import the store's public names, with those errors and result files, from this package.
"""

from services.orchestrator.result_files import (
    AUDIO_TENSOR,
    RESULT_FILE,
    RESULT_TENSOR,
    AudioReader,
    EncodedReader,
    ResultReader,
)
from services.orchestrator.result_writers import AudioWriter, EncodedWriter, ResultWriter
from services.orchestrator.sizes import MinFree, parse_size
from services.orchestrator.store.database import LOCK_NAME
from services.orchestrator.store.jobstore import JobStore
from services.orchestrator.store.records import (
    ACTIVE_STATES,
    INPUT_IMAGES,
    TERMINAL_STATES,
    JobRecord,
    JobState,
    SavedImages,
    Usage,
)
from services.orchestrator.store.schema import SCHEMA_VERSION
from services.orchestrator.store_errors import (
    DuplicateRequestId,
    InvalidTransition,
    LeaseLost,
    ResultGone,
    StateDirLocked,
    StoreError,
    StoreFull,
    UnknownJob,
)
from services.orchestrator.stored_result import StoredResult

__all__ = [
    "ACTIVE_STATES",
    "AUDIO_TENSOR",
    "INPUT_IMAGES",
    "LOCK_NAME",
    "RESULT_FILE",
    "RESULT_TENSOR",
    "SCHEMA_VERSION",
    "TERMINAL_STATES",
    "AudioReader",
    "AudioWriter",
    "DuplicateRequestId",
    "EncodedReader",
    "EncodedWriter",
    "InvalidTransition",
    "JobRecord",
    "JobState",
    "JobStore",
    "LeaseLost",
    "MinFree",
    "ResultGone",
    "ResultReader",
    "ResultWriter",
    "SavedImages",
    "StateDirLocked",
    "StoreError",
    "StoreFull",
    "StoredResult",
    "UnknownJob",
    "Usage",
    "parse_size",
]
