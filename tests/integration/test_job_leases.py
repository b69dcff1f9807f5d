"""Claims under fenced leases (services/orchestrator/store/leases.py) on a real PostgreSQL server: two
replicas claiming the same queue concurrently take every job exactly once; an expired lease is requeued and
claimed again with a new epoch, which fences the former owner."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from services.orchestrator.store.leases import Claim, JobLeases
from services.orchestrator.store.postgres import PostgresDatabase
from services.orchestrator.store.records import JobRecord, JobState
from services.orchestrator.store.rows import JobRows
from tests.helpers.servers import Postgres, postgres


@pytest.fixture(scope="module")
def server() -> Iterator[Postgres]:
    with postgres() as running:
        yield running


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


def test_two_replicas_claiming_one_queue_take_each_job_once(server: Postgres) -> None:
    databases = [PostgresDatabase.connect(server.dsn) for _ in range(3)]
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
        database.close()


def test_an_expired_lease_is_requeued_and_the_former_owner_is_fenced(server: Postgres) -> None:
    database = PostgresDatabase.connect(server.dsn)
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
    database.close()
