"""The job database on PostgreSQL: the Database interface of database.py, so that rows.py's SQL runs unchanged.

rows.py writes SQLite's `?` placeholders; `_Connection.execute` rewrites them to psycopg's `%s` (the store's SQL
holds no literal `?`). Rows answer by column name and by position, as sqlite3.Row does. One connection, guarded
by a re-entrant lock as SQLite's is; a transaction is one PostgreSQL transaction, rolled back on any error.
`SCHEMA` has the same tables and columns as schema.py's, in PostgreSQL's types.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from services.orchestrator.store.models import POSTGRES_TABLE as POSTGRES_MODELS_TABLE
from services.orchestrator.store_errors import StoreError, StoreUnavailable

SCHEMA_VERSION = 9

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    seq BIGSERIAL PRIMARY KEY,
    job_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    request_id TEXT,
    priority TEXT NOT NULL,
    request BYTEA NOT NULL,
    state INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    deadline_at DOUBLE PRECISION,
    error_code INTEGER,
    error_message TEXT NOT NULL DEFAULT '',
    timings TEXT NOT NULL DEFAULT '{}',
    num_frames_out INTEGER NOT NULL DEFAULT 0,
    fps_out DOUBLE PRECISION NOT NULL DEFAULT 0,
    last_stage TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0,
    passes_run INTEGER NOT NULL DEFAULT 0,
    passes_skipped INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '',         -- the replica running the job ('' while queued)
    lease_epoch BIGINT NOT NULL DEFAULT 0,  -- +1 per claim: fences a former owner's writes
    lease_until DOUBLE PRECISION,           -- the database's unix seconds the owner's lease lasts to
    notices TEXT NOT NULL DEFAULT '[]',     -- JSON [Notice] (services/orchestrator/notices.py)
    preemptions INTEGER NOT NULL DEFAULT 0, -- times the job yielded its DiT slot to a higher class
    UNIQUE (tenant, request_id)
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, state, finished_at);
CREATE TABLE IF NOT EXISTS intermediates (
    job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    stage TEXT NOT NULL,
    file TEXT NOT NULL,
    done_at DOUBLE PRECISION NOT NULL,
    bytes BIGINT NOT NULL DEFAULT 0,
    position INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, stage)
);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    file TEXT NOT NULL,
    shape TEXT NOT NULL,
    fps DOUBLE PRECISION NOT NULL,
    pieces TEXT NOT NULL,
    saved_at DOUBLE PRECISION NOT NULL,
    bytes BIGINT NOT NULL DEFAULT 0,
    media_type TEXT NOT NULL DEFAULT '',
    encoded_file TEXT,
    encoded_bytes BIGINT NOT NULL DEFAULT 0,
    raw_kept INTEGER NOT NULL DEFAULT 1,
    audio_file TEXT,
    audio_shape TEXT NOT NULL DEFAULT '[]',
    audio_rate INTEGER NOT NULL DEFAULT 0
)
"""

# What a database of an older version lacks, added to it (each statement a no-op on a newer one). Version 7
# keeps each job's notices, version 8 a result's sound, version 9 each job's preemptions.
MIGRATIONS = """
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS preemptions INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS notices TEXT NOT NULL DEFAULT '[]';
ALTER TABLE results ADD COLUMN IF NOT EXISTS audio_file TEXT;
ALTER TABLE results ADD COLUMN IF NOT EXISTS audio_shape TEXT NOT NULL DEFAULT '[]';
ALTER TABLE results ADD COLUMN IF NOT EXISTS audio_rate INTEGER NOT NULL DEFAULT 0
"""

CONNECT_TIMEOUT_S = 5
SCHEMA_LOCK = 0x5354414745444946  # the advisory lock under which replicas create the tables


class Row(tuple[Any, ...]):
    """A result row that answers by position and by column name, as sqlite3.Row."""

    names: tuple[str, ...]

    def __new__(cls, names: tuple[str, ...], values: Sequence[Any]) -> Row:
        row = super().__new__(cls, values)
        row.names = names
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(self.names.index(key))
        return super().__getitem__(key)

    def keys(self) -> tuple[str, ...]:
        return self.names


def _row_factory(cursor: Any) -> Any:
    names = tuple(column.name for column in cursor.description or ())
    return lambda values: Row(names, values)


class _Cursor:
    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def fetchone(self) -> Row | None:
        row: Row | None = self._cursor.fetchone()
        return row

    def fetchall(self) -> list[Row]:
        rows: list[Row] = self._cursor.fetchall()
        return rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self.fetchall())


class _Connection:
    """What rows.py calls on a transaction's connection: `execute` with `?` placeholders."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Cursor:
        """Runs `sql`; a unique key met raises UniqueViolation here, where rows.py expects SQLite's
        IntegrityError (the transaction is then rolled back as a whole)."""
        import psycopg

        try:
            return _Cursor(self._connection.execute(sql.replace("?", "%s"), tuple(params)))
        except psycopg.errors.UniqueViolation as error:
            raise UniqueViolation(str(error)) from None

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        _executemany(self._connection, sql, rows)

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        started: contextlib.AbstractContextManager[Any] = self._connection.transaction()
        return started


def _executemany(connection: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    with connection.cursor() as cursor:
        cursor.executemany(sql.replace("?", "%s"), [tuple(row) for row in rows])


class PostgresDatabase:
    """The job database on one PostgreSQL connection (`dsn`), with the Database interface of database.py."""

    now_sql = "EXTRACT(EPOCH FROM clock_timestamp())"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    for_update = " FOR UPDATE"

    def __init__(self, connection: Any, dsn: str = "") -> None:
        self._connection: Any | None = connection
        self._dsn = dsn
        self.mutex = threading.RLock()

    @classmethod
    def connect(cls, dsn: str) -> PostgresDatabase:
        """Connects and brings the schema to SCHEMA_VERSION; StoreError naming the problem otherwise."""
        database = cls(_open(dsn), dsn)
        with database.transaction() as db:
            # Replicas starting together create the tables one at a time (CREATE ... IF NOT EXISTS races).
            db.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
            for statement in [*SCHEMA.split(";"), POSTGRES_MODELS_TABLE]:  # the models table: store/models.py
                if statement.strip():
                    db.execute(statement)
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                raise StoreError(f"the job database has schema version {row[0]}; this version reads {SCHEMA_VERSION}")
            elif row[0] < SCHEMA_VERSION:
                for statement in MIGRATIONS.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        return database

    def connection(self) -> Any:
        if self._connection is None:
            raise StoreError("the job store is closed")
        if self._connection.broken or self._connection.closed:  # the server restarted or the link broke
            self._connection = _open(self._dsn)
        return self._connection

    def close(self, *, checkpoint: bool = True) -> bool:
        with self.mutex:
            if self._connection is None:
                return False
            self._connection.close()
            self._connection = None
            return True

    # One statement is a transaction of its own on an autocommit connection: one round trip, not three.
    def fetchone(self, sql: str, params: tuple[Any, ...]) -> Row | None:
        with self._statements() as db:
            return db.execute(sql, params).fetchone()

    def fetchall(self, sql: str, params: tuple[Any, ...]) -> list[Row]:
        with self._statements() as db:
            return db.execute(sql, params).fetchall()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Connection]:
        """One transaction; rolled back on any error, database errors raised as StoreError."""
        with self._statements() as db, db.transaction():
            yield db

    @contextlib.contextmanager
    def _statements(self) -> Iterator[_Connection]:
        """The connection, for this thread alone, with database errors raised as StoreError."""
        import psycopg

        with self.mutex:
            connection = self.connection()
            try:
                yield _Connection(connection)
            except psycopg.OperationalError as error:  # the connection broke: the next call opens another
                raise StoreUnavailable(f"the job database cannot be reached: {_first_line(error)}") from None
            except psycopg.Error as error:
                raise StoreError(f"the job database failed: {error}") from None


class UniqueViolation(StoreError):
    """An insert met a row with the same unique key."""


def _open(dsn: str) -> Any:
    """A connection in autocommit mode (each transaction explicit); StoreUnavailable when none can be made."""
    import psycopg

    try:
        return psycopg.connect(dsn, autocommit=True, row_factory=_row_factory, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.Error as error:
        raise StoreUnavailable(f"cannot reach the job database: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
