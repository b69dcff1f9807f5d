"""Claims under fenced leases (services/orchestrator/store/leases.py) on both job databases, PostgreSQL on a
real server: two claimers of the same queue, at once, take every job exactly once; an expired lease is
requeued and claimed again with a new epoch, which fences the former owner; renewal says which leases are lost."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from services.orchestrator.store.database import Database
from services.orchestrator.store.leases import Claim, JobLeases
from services.orchestrator.store.postgres import PostgresDatabase
from services.orchestrator.store.records import JobRecord, JobState
from services.orchestrator.store.rows import JobRows
from services.orchestrator.store.schema import migrate
from stagediff.local.servers import Postgres


@pytest.fixture
def server(postgres_server: Postgres) -> Postgres:
    """The session's server, with a database of this test's own."""
    return postgres_server.with_new_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def connect(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Any]:
    """Opens a connection to one job database (all of a test's connections reach the same database)."""
    if request.param == "postgresql":
        server: Postgres = request.getfixturevalue("server")
        return lambda: PostgresDatabase.connect(server.dsn)
    path = tmp_path_factory.mktemp("jobs") / "jobs.sqlite3"
    shared = Database.connect(path, "NORMAL")
    migrate(shared, path, lambda job_id, file: 0)
    return lambda: shared


def _queue(rows: JobRows, count: int) -> list[str]:
    ids = [uuid.uuid4().hex for _ in range(count)]
    for job_id in ids:
        record = JobRecord(
            job_id=job_id,
            tenant="t",
            request_id="",
            priority="normal",
            request=b"",
            state=JobState.JOB_STATE_QUEUED,
            created_at=1.0,
        )
        rows.insert(record, None)
    return ids


def test_two_claimers_of_one_queue_take_each_job_once(connect: Callable[[], Any]) -> None:
    databases = [connect() for _ in range(3)]
    rows = JobRows(databases[0])
    ids = _queue(rows, 20)
    taken: dict[str, list[str]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def claim_all(owner: str, database: PostgresDatabase) -> None:
        leases = JobLeases(database, owner)
        start.wait()
        for job_id in ids:
            if leases.claim(job_id) is not None:
                taken[owner].append(job_id)

    threads = [
        threading.Thread(target=claim_all, args=(name, db)) for name, db in zip("ab", databases[1:], strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(taken["a"] + taken["b"]) == sorted(ids)
    for job_id in ids:
        record = rows.get(job_id)
        assert record is not None and record.attempts == 1 and record.state == JobState.JOB_STATE_RUNNING
    for database in databases:
        database.close(checkpoint=False)


def test_an_expired_lease_is_requeued_and_the_former_owner_is_fenced(connect: Callable[[], Any]) -> None:
    database = connect()
    (job_id,) = _queue(JobRows(database), 1)
    stale = JobLeases(database, "a", ttl_s=0.2)
    first = stale.claim(job_id)
    assert first is not None and first.epoch == 1 and stale.holds(first)
    time.sleep(0.3)
    leader = JobLeases(database, "b")
    assert leader.requeue_expired() == [job_id]
    second = leader.claim(job_id)
    assert second == Claim(job_id, 2)
    assert not stale.holds(first) and stale.renew([first]) == {job_id}
    assert leader.renew([second]) == set() and leader.holds(second)
    record = JobRows(database).get(job_id)
    assert record is not None and record.attempts == 2
    database.close(checkpoint=False)
