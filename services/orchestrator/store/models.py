"""The models the DiT replicas have reported, kept in the job database so that a model whose DiT pool is at zero
stays served: an orchestrator that starts (or another replica that joins) while no DiT of a model runs still
knows its family, chain and limits, admits its requests, and keeps them waiting for a replica
(--cold-start-timeout) instead of answering that the model does not exist.

One row per model id: the StageInfo a DiT replica of it last reported (serialized) and when it was last seen.
A model not reported for FORGET_AFTER_S is not loaded any more: that is how a model taken out of service leaves.
The table is additive: it is created where missing whatever the schema version, and older replicas ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.orchestrator.store.database import JobDatabase

FORGET_AFTER_S = 7 * 24 * 3600.0

SQLITE_TABLE = """
CREATE TABLE IF NOT EXISTS models (
    model TEXT PRIMARY KEY,
    info BLOB NOT NULL,                     -- the DiT's StageInfo, serialized
    seen_at REAL NOT NULL                   -- unix seconds a DiT last reported it
)
"""
POSTGRES_TABLE = """
CREATE TABLE IF NOT EXISTS models (
    model TEXT PRIMARY KEY,
    info BYTEA NOT NULL,
    seen_at DOUBLE PRECISION NOT NULL
)
"""


@dataclass(frozen=True)
class KnownModel:
    model: str
    info: bytes  # stages_pb2.StageInfo, serialized
    seen_at: float


class ModelRows:
    """The rows of the models table."""

    def __init__(self, database: JobDatabase) -> None:
        self.database = database

    def save(self, model: str, info: bytes, seen_at: float) -> None:
        with self.database.transaction() as db:
            db.execute(
                "INSERT INTO models (model, info, seen_at) VALUES (?, ?, ?) "
                "ON CONFLICT (model) DO UPDATE SET info = excluded.info, seen_at = excluded.seen_at",
                (model, info, seen_at),
            )

    def load(self, now: float) -> list[KnownModel]:
        """The models seen within FORGET_AFTER_S of `now`, by id."""
        rows = self.database.fetchall(
            "SELECT model, info, seen_at FROM models WHERE seen_at >= ? ORDER BY model", (now - FORGET_AFTER_S,)
        )
        return [KnownModel(row[0], bytes(row[1]), float(row[2])) for row in rows]
