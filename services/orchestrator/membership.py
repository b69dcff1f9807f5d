"""Which orchestrator replicas there are, which one leads, and how to reach each: the cluster's membership.

Two implementations of one protocol:
- `SoloMembership`: the embedded store (SQLite in the state directory) serves one orchestrator, which always
  leads and owns every job;
- `PostgresMembership`: replicas on one PostgreSQL database. Each one writes a heartbeat row
  `replicas(replica_id, endpoint, heartbeat_at)` naming the address its peers reach it at, and takes part in
  the election of leadership.py every `round_s`: the leader renews its lease, a follower takes a lease that
  expired or was resigned. A leader that cannot renew stops leading once its trust window ends (before its
  lease expires in the database), so two replicas never both believe they lead.

`run` calls `on_lead` when this replica becomes the leader and `on_follow` when it stops; both run on the
event loop, the database calls in a thread. A broken connection is opened again at the next round; until
then a leader stops leading when its trust runs out, and a follower answers admissions UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from services.orchestrator.leadership import Election, Lease
from services.orchestrator.store.postgres import SCHEMA_LOCK

logger = logging.getLogger(__name__)

LEADER_LEASE_S = 6.0  # a leader's SIGKILL: a follower leads within this plus one round
ROUND_S = 1.0  # how often followers try for the lease and the leader renews it
HEARTBEAT_STALE_S = 30.0  # a replica whose heartbeat is older is not relayed to

SCHEMA = """
CREATE TABLE IF NOT EXISTS replicas (
    replica_id TEXT PRIMARY KEY,
    endpoint TEXT NOT NULL,
    heartbeat_at TIMESTAMPTZ NOT NULL
)
"""


@runtime_checkable
class Membership(Protocol):
    """What the orchestrator asks of its cluster: who it is, whether it leads, where the others are."""

    replica_id: str

    def is_leader(self) -> bool: ...

    def leader_endpoint(self) -> str | None:
        """The current leader's endpoint as last seen (None: no leader now, or this replica leads)."""
        ...

    async def endpoint_of(self, replica_id: str) -> str | None:
        """Where a live replica answers; None for an unknown one or one whose heartbeat stopped."""
        ...

    async def run(self, on_lead: Callable[[], Awaitable[None]], on_follow: Callable[[], Awaitable[None]]) -> None:
        """Takes part in the cluster until cancelled."""
        ...

    async def resign(self) -> None:
        """Gives leadership up at once (a follower leads at its next round) and stops trying for it."""
        ...


class SoloMembership:
    """One orchestrator on the embedded store: always the leader."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._leading = True

    def is_leader(self) -> bool:
        return self._leading

    def leader_endpoint(self) -> str | None:
        return None

    async def endpoint_of(self, replica_id: str) -> str | None:
        return None

    async def run(self, on_lead: Callable[[], Awaitable[None]], on_follow: Callable[[], Awaitable[None]]) -> None:
        await on_lead()
        await asyncio.get_running_loop().create_future()  # until cancelled

    async def resign(self) -> None:
        self._leading = False


class PostgresMembership:
    """A replica of several on one PostgreSQL database (`dsn`), reachable by its peers at `endpoint`."""

    def __init__(
        self,
        dsn: str,
        replica_id: str,
        endpoint: str,
        *,
        lease_s: float = LEADER_LEASE_S,
        round_s: float = ROUND_S,
        connect: Callable[[str], Any] | None = None,
    ) -> None:
        if not 0 < round_s < lease_s / 2:
            raise ValueError(f"round {round_s} s: use less than half the lease ({lease_s} s)")
        self.dsn = dsn
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.lease_s = lease_s
        self.round_s = round_s
        self._connect = connect or _connect
        self._connection: Any | None = None
        self._election: Election | None = None
        self._lock = threading.Lock()  # one database call at a time on the connection
        self._lease: Lease | None = None
        self._leader_endpoint: str | None = None
        self._resigned = False

    def is_leader(self) -> bool:
        lease = self._lease
        return lease is not None and lease.trusted() and not self._resigned

    def leader_endpoint(self) -> str | None:
        return None if self.is_leader() else self._leader_endpoint

    async def endpoint_of(self, replica_id: str) -> str | None:
        if replica_id == self.replica_id:
            return self.endpoint
        try:
            return await asyncio.to_thread(self._endpoint_of, replica_id)
        except Exception as error:  # the database is unreachable now: as if the replica were unknown
            logger.warning("cannot look up replica %s: %s", replica_id, error)
            return None

    async def run(self, on_lead: Callable[[], Awaitable[None]], on_follow: Callable[[], Awaitable[None]]) -> None:
        leading = False
        try:
            while True:
                started = time.monotonic()
                try:
                    await asyncio.to_thread(self._round)
                except Exception as error:  # the database is unreachable or restarting: try again next round
                    logger.warning("membership round failed: %s", error)
                    await asyncio.to_thread(self._drop_connection)
                if self.is_leader() and not leading:
                    leading = True
                    logger.info("this replica (%s) leads the orchestrators", self.replica_id)
                    await on_lead()
                elif leading and not self.is_leader():
                    leading = False
                    logger.info("this replica (%s) no longer leads; leader: %s", self.replica_id, self._leader_endpoint)
                    await on_follow()
                await asyncio.sleep(max(0.0, self.round_s - (time.monotonic() - started)))
        finally:
            await asyncio.to_thread(self._drop_connection)

    async def resign(self) -> None:
        self._resigned = True
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):  # unreachable: the lease expires by itself
                await asyncio.to_thread(self._resign, lease)

    # -- database calls, in a thread --

    def _round(self) -> None:
        with self._lock:
            election = self._open()
            election.connection.execute(
                "INSERT INTO replicas (replica_id, endpoint, heartbeat_at) VALUES (%s, %s, now())"
                " ON CONFLICT (replica_id) DO UPDATE SET endpoint = EXCLUDED.endpoint, heartbeat_at = now()",
                (self.replica_id, self.endpoint),
            )
            if self._resigned:
                self._lease = None
            elif self._lease is not None:
                self._lease = election.renew(self._lease)
            else:
                self._lease = election.acquire()
            row = election.connection.execute(
                "SELECT replicas.endpoint FROM leader JOIN replicas ON replicas.replica_id = leader.leader_id"
                " WHERE leader.name = %s AND leader.expires_at > now()",
                (election.name,),
            ).fetchone()
            self._leader_endpoint = None if row is None else str(row[0])

    def _endpoint_of(self, replica_id: str) -> str | None:
        with self._lock:
            election = self._open()
            row = election.connection.execute(
                "SELECT endpoint FROM replicas"
                " WHERE replica_id = %s AND heartbeat_at > now() - make_interval(secs => %s)",
                (replica_id, HEARTBEAT_STALE_S),
            ).fetchone()
        return None if row is None else str(row[0])

    def _resign(self, lease: Lease) -> None:
        with self._lock:
            self._open().resign(lease)

    def _open(self) -> Election:
        if self._election is None:
            self._connection = self._connect(self.dsn)
            with self._connection.transaction():  # replicas starting together create the tables one at a time
                self._connection.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                self._connection.execute(SCHEMA)
                self._election = Election(self._connection, self.replica_id, ttl_s=self.lease_s)
        return self._election

    def _drop_connection(self) -> None:
        with self._lock:
            connection, self._connection, self._election = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


def _connect(dsn: str) -> Any:
    import psycopg

    return psycopg.connect(dsn, autocommit=True, connect_timeout=5)
