"""The job rows (services/orchestrator/store/rows.py) on a real PostgreSQL server, through the same SQL as
SQLite's: admission order, request ids per tenant, state moves and deletion."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.orchestrator.store.postgres import PostgresDatabase
from services.orchestrator.store.records import JobRecord, JobState
from services.orchestrator.store.rows import JobRows
from services.orchestrator.store_errors import DuplicateRequestId, StoreError
from stagediff.local.servers import Postgres
from stagediff.v1 import stages_pb2


@pytest.fixture
def server(postgres_server: Postgres) -> Postgres:
    """The session's server, with a database of this test's own."""
    return postgres_server.with_new_database()


@pytest.fixture
def rows(server: Postgres) -> Iterator[JobRows]:
    database = PostgresDatabase.connect(server.dsn)
    yield JobRows(database)
    database.close()


def _record(tenant: str, request_id: str = "") -> JobRecord:
    return JobRecord(
        job_id=uuid.uuid4().hex,
        tenant=tenant,
        request_id=request_id,
        priority="normal",
        request=b"\x08\x01",
        state=JobState.JOB_STATE_QUEUED,
        created_at=1.0,
    )


def test_jobs_are_numbered_in_admission_order_and_read_back(rows: JobRows) -> None:
    first, second = rows.insert(_record("a"), None), rows.insert(_record("b"), None)
    assert second.seq > first.seq > 0
    stored = rows.get(first.job_id)
    assert stored is not None and stored.tenant == "a" and stored.request == b"\x08\x01"
    assert stored.state == JobState.JOB_STATE_QUEUED


def test_a_request_id_is_unique_per_tenant_and_a_job_id_once(rows: JobRows) -> None:
    job = rows.insert(_record("a", "req-1"), None)
    with pytest.raises(DuplicateRequestId):
        rows.insert(_record("a", "req-1"), None)
    rows.insert(_record("b", "req-1"), None)  # another tenant's id space
    found = rows.find_by_request_id("a", "req-1")
    assert found is not None and found.job_id == job.job_id
    with pytest.raises(StoreError, match="already stored"):
        rows.insert(JobRecord(**{**job.__dict__, "request_id": "", "seq": 0}), None)


def test_state_moves_and_deletion(rows: JobRows) -> None:
    job = rows.insert(_record("c"), None)
    running, _ = rows.update_state(job.job_id, JobState.JOB_STATE_RUNNING, {"started_at": 2.0})
    assert running.state == JobState.JOB_STATE_RUNNING and running.attempts == 1
    failed, _ = rows.update_state(job.job_id, JobState.JOB_STATE_FAILED, {"finished_at": 3.0})
    assert failed.state == JobState.JOB_STATE_FAILED
    assert rows.delete(job.job_id) and rows.get(job.job_id) is None


def test_a_newer_schema_is_refused_and_replicas_starting_together_create_it_once(server: Postgres) -> None:
    """The schema is created under an advisory lock (replicas that start at once do not race), and a database
    a newer version wrote is refused, naming both versions."""
    import psycopg

    from services.orchestrator.store.postgres import SCHEMA_VERSION

    with ThreadPoolExecutor(4) as pool:
        for database in pool.map(lambda _: PostgresDatabase.connect(server.dsn), range(4)):
            database.close()
    with psycopg.connect(server.dsn, autocommit=True) as connection:
        assert connection.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)
        connection.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}; this version reads {SCHEMA_VERSION}"):
        PostgresDatabase.connect(server.dsn)


def test_a_version_6_database_gains_notices_and_keeps_its_jobs(server: Postgres) -> None:
    """Version 6 had no notices column (nor a result's sound, nor preemption counts): connecting adds them (its jobs
    have none) and the version becomes the current one; a running job's notices are then written and read back as
    SQLite's are, and its preemptions counted."""
    import psycopg

    from services.orchestrator.store.postgres import SCHEMA_VERSION

    database = PostgresDatabase.connect(server.dsn)
    job = JobRows(database).insert(_record("a"), None)
    database.close()
    with psycopg.connect(server.dsn, autocommit=True) as connection:
        connection.execute("ALTER TABLE jobs DROP COLUMN notices")
        connection.execute("ALTER TABLE jobs DROP COLUMN preemptions")
        for column in ("audio_file", "audio_shape", "audio_rate"):
            connection.execute(f"ALTER TABLE results DROP COLUMN {column}")
        connection.execute("UPDATE schema_version SET version = 6")
    database = PostgresDatabase.connect(server.dsn)
    try:
        rows = JobRows(database)
        assert database.fetchone("SELECT version FROM schema_version", ())[0] == SCHEMA_VERSION == 9
        assert rows.get(job.job_id).notices == [] and rows.get(job.job_id).preemptions == 0
        rows.update_state(job.job_id, JobState.JOB_STATE_RUNNING, {"started_at": 2.0})
        notice = stages_pb2.Notice(field="prompt", given="721 tokens", used="512 tokens", source="text-encoder")
        assert rows.set_notices(job.job_id, [notice])
        assert rows.get(job.job_id).notices == [notice]
        assert rows.count_preemption(job.job_id) and rows.get(job.job_id).preemptions == 1
    finally:
        database.close()


def test_a_result_keeps_its_sound_as_on_sqlite(rows: JobRows) -> None:
    """Version 8's sound columns: a result row names its sound file, shape and rate, and the file is in use."""
    job = rows.insert(_record("a"), None)
    rows.update_state(job.job_id, JobState.JOB_STATE_RUNNING, {"started_at": 2.0})
    rows.commit_result(
        job.job_id,
        file="result-frames.npy",
        shape=(9, 16, 32, 3),
        fps=16.0,
        pieces=[(0, 9)],
        at=3.0,
        nbytes=100,
        media_type="",
        encoded_file=None,
        encoded_bytes=0,
        raw_kept=True,
        timings=None,
        audio=("result-audio.npy", (2, 13500), 24000),
    )
    row = rows.result(job.job_id)
    assert (row["audio_file"], row["audio_shape"], row["audio_rate"]) == ("result-audio.npy", "[2, 13500]", 24000)
    assert (job.job_id, "result-audio.npy") in rows.files_in_use()[1]
