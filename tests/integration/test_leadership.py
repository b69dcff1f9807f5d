"""The leader lease (services/orchestrator/leadership.py) on a real PostgreSQL server: one leader at a time,
terms that fence an old leader, resignation and expiry."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from services.orchestrator.leadership import Election
from stagediff.local.servers import Postgres


@pytest.fixture
def database(postgres_server: Postgres) -> Postgres:
    return postgres_server.with_new_database()


@pytest.fixture
def elections(database: Postgres, request: pytest.FixtureRequest) -> Iterator[tuple[Election, Election]]:
    name = request.node.name[:60]
    with psycopg.connect(database.dsn, autocommit=True) as a, psycopg.connect(database.dsn, autocommit=True) as b:
        yield Election(a, "replica-a", name=name, ttl_s=1.0), Election(b, "replica-b", name=name, ttl_s=1.0)


def test_one_replica_leads_and_renewal_keeps_its_term(elections: tuple[Election, Election]) -> None:
    a, b = elections
    lease = a.acquire()
    assert lease is not None and lease.term == 1 and lease.trusted()
    assert b.acquire() is None
    renewed = a.renew(lease)
    assert renewed is not None and renewed.term == 1
    again = a.acquire()  # the holder's acquire renews, without a new term
    assert again is not None and again.term == 1
    assert a.current() == ("replica-a", 1) == b.current()


def test_a_resignation_hands_over_at_once_and_fences_the_old_term(elections: tuple[Election, Election]) -> None:
    a, b = elections
    first = a.acquire()
    assert first is not None and a.resign(first)
    second = b.acquire()
    assert second is not None and second.term == first.term + 1
    assert a.renew(first) is None and not a.resign(first)
    assert b.current() == ("replica-b", second.term)


def test_an_expired_lease_goes_to_a_follower_and_the_old_leader_cannot_renew(
    elections: tuple[Election, Election],
) -> None:
    a, b = elections
    first = a.acquire()
    assert first is not None
    time.sleep(1.2)  # past the 1 s lease, and past the leader's own trust window before it
    assert not first.trusted()
    second = b.acquire()
    assert second is not None and second.term == first.term + 1
    assert a.renew(first) is None
    assert a.acquire() is None


def test_a_lease_shorter_than_a_second_is_refused(database: Postgres) -> None:
    with (
        psycopg.connect(database.dsn, autocommit=True) as connection,
        pytest.raises(ValueError, match="lease ttl 0.5"),
    ):
        Election(connection, "replica-a", ttl_s=0.5)
