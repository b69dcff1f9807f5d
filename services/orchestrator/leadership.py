"""Which orchestrator replica leads (admits and dispatches): a lease row in PostgreSQL with a term.

The row `leader(name, leader_id, term, expires_at)` is the truth, and the database's clock is the only clock
compared: a replica takes a vacant or expired lease (the term goes up by one), renews its own while its term
holds, and resigns on shutdown (the lease expires at once, so a follower takes it without waiting). A leader
trusts itself for less than the lease (`trust_s` after the renewal was sent), so that a leader cut off from
the database stops acting before another can start. The term fences a leader's writes: a renewal or a
resignation of an older term changes nothing. Every call may block on the database: callers on an event loop
run them in a thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS leader (
    name TEXT PRIMARY KEY,
    leader_id TEXT NOT NULL,
    term BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
)
"""


@dataclass(frozen=True)
class Lease:
    """A lease this replica holds: its term, and until when (monotonic) it trusts itself to lead."""

    term: int
    trusted_until: float

    def trusted(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.trusted_until


class Election:
    """One replica's view of the lease `name`, on a psycopg connection in autocommit mode."""

    def __init__(self, connection: Any, replica_id: str, *, name: str = "dispatch", ttl_s: float = 10.0) -> None:
        if not 1.0 <= ttl_s <= 600.0:
            raise ValueError(f"lease ttl {ttl_s}: use 1 to 600 seconds")
        self.connection = connection
        self.replica_id = replica_id
        self.name = name
        self.ttl_s = ttl_s
        self.trust_s = ttl_s * 2 / 3
        self.connection.execute(SCHEMA)

    def acquire(self) -> Lease | None:
        """Takes the lease if it is vacant or expired (a new term), or renews it if it is ours; None if another
        replica holds it."""
        sent = time.monotonic()
        row = self.connection.execute(
            """
            INSERT INTO leader (name, leader_id, term, expires_at)
            VALUES (%(name)s, %(me)s, 1, now() + make_interval(secs => %(ttl)s))
            ON CONFLICT (name) DO UPDATE SET
                leader_id = EXCLUDED.leader_id,
                term = CASE WHEN leader.leader_id = EXCLUDED.leader_id AND leader.expires_at > now()
                            THEN leader.term ELSE leader.term + 1 END,
                expires_at = EXCLUDED.expires_at
            WHERE leader.expires_at <= now() OR leader.leader_id = EXCLUDED.leader_id
            RETURNING term
            """,
            {"name": self.name, "me": self.replica_id, "ttl": self.ttl_s},
        ).fetchone()
        return None if row is None else Lease(int(row[0]), sent + self.trust_s)

    def renew(self, lease: Lease) -> Lease | None:
        """Extends `lease` while its term is still ours; None once another term has begun (stop leading)."""
        sent = time.monotonic()
        row = self.connection.execute(
            """
            UPDATE leader SET expires_at = now() + make_interval(secs => %(ttl)s)
            WHERE name = %(name)s AND leader_id = %(me)s AND term = %(term)s AND expires_at > now()
            RETURNING term
            """,
            {"name": self.name, "me": self.replica_id, "term": lease.term, "ttl": self.ttl_s},
        ).fetchone()
        return None if row is None else Lease(lease.term, sent + self.trust_s)

    def resign(self, lease: Lease) -> bool:
        """Gives the lease up at once (the next `acquire` of any replica takes it); False if it was gone."""
        row = self.connection.execute(
            """
            UPDATE leader SET expires_at = now()
            WHERE name = %(name)s AND leader_id = %(me)s AND term = %(term)s
            RETURNING term
            """,
            {"name": self.name, "me": self.replica_id, "term": lease.term},
        ).fetchone()
        return row is not None

    def current(self) -> tuple[str, int] | None:
        """The replica that holds an unexpired lease and its term, or None."""
        row = self.connection.execute(
            "SELECT leader_id, term FROM leader WHERE name = %(name)s AND expires_at > now()", {"name": self.name}
        ).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))
