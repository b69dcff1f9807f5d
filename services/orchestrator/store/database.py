"""The state directory's SQLite connection: opening it, transactions, and who owns the directory.

One connection, guarded by a re-entrant lock (`mutex`), so every method may be called from any thread.
`transaction` is BEGIN IMMEDIATE ... COMMIT, rolled back on any error; it and the fetch methods raise
database failures as StoreError (StoreFull when the disk is full). `connect` and a caller holding `mutex`
around `connection()` get sqlite3.Error as it is, and say themselves what failed.

One process owns a state directory at a time: `lock_state_dir` takes an exclusive flock on its LOCK file,
which the kernel drops when the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from services.orchestrator.store_errors import StateDirLocked, StoreError, db_error


class JobDatabase(Protocol):
    """What rows.py, retention.py and leases.py use of a job database: this module's SQLite Database or
    postgres.py's PostgresDatabase. Both run the same SQL, with `?` placeholders."""

    now_sql: str
    """The current unix time in seconds, as SQL."""
    skip_locked: str
    """Appended to a SELECT of rows to claim: lets one claimer pass rows another holds ('' where one process writes)."""
    for_update: str
    """Appended to a SELECT of a row the transaction then changes: locks it ('' where one process writes)."""
    mutex: Any

    def connection(self) -> Any: ...

    def close(self, *, checkpoint: bool = True) -> bool: ...

    # One statement, a transaction of its own (a write's rows come back with RETURNING).
    def fetchone(self, sql: str, params: tuple[Any, ...]) -> Any: ...

    def fetchall(self, sql: str, params: tuple[Any, ...]) -> list[Any]: ...

    def transaction(self) -> contextlib.AbstractContextManager[Any]: ...


DB_NAME = "jobs.sqlite3"
LOCK_NAME = "LOCK"


class Database:
    """The one connection of a state directory's database, and the lock that guards it."""

    # What the SQL that both job databases run writes differently (postgres.py has PostgreSQL's):
    # the current unix time in seconds, and the clause that lets a claimer pass rows another holds.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    skip_locked = ""
    for_update = ""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection: sqlite3.Connection | None = connection
        self.mutex = threading.RLock()

    @classmethod
    def connect(cls, path: Path, synchronous: str) -> Database:
        """Opens the database in WAL mode with `synchronous` (NORMAL or FULL) and foreign keys on."""
        connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            connection.row_factory = sqlite3.Row
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={synchronous}")
            connection.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        return cls(connection)

    def connection(self) -> sqlite3.Connection:
        """The open connection; StoreError once closed. Hold `mutex` while using it."""
        if self._connection is None:
            raise StoreError("the job store is closed")
        return self._connection

    def close(self, *, checkpoint: bool = True) -> bool:
        """Closes, with `checkpoint` first moving the WAL into the database; False if it was closed already."""
        with self.mutex:
            if self._connection is None:
                return False
            if checkpoint:
                with contextlib.suppress(sqlite3.Error):
                    self._connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._connection.close()
            self._connection = None
            return True

    def fetchone(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Row | None:
        with self.mutex:
            try:
                row: sqlite3.Row | None = self.connection().execute(sql, params).fetchone()
                return row
            except sqlite3.Error as error:
                raise db_error(error) from None

    def fetchall(self, sql: str, params: tuple[Any, ...]) -> list[sqlite3.Row]:
        with self.mutex:
            try:
                return self.connection().execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise db_error(error) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; rolled back on any error, database errors raised as StoreError."""
        with self.mutex:
            db = self.connection()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise db_error(error) from None
            try:
                yield db
                db.execute("COMMIT")
            except BaseException as error:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                if isinstance(error, sqlite3.Error):
                    raise db_error(error) from None
                raise


def lock_state_dir(state_dir: Path, lock_file: IO[bytes]) -> None:
    """Takes the state directory's lock (its open LOCK file) for this process; StateDirLocked if another has it.

    The file is closed when the lock is refused; otherwise the caller holds it open for as long as it owns
    the directory.
    """
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise StateDirLocked(f"state dir {state_dir} is in use by another process") from None


def close_quietly(database: JobDatabase | None, lock_file: IO[bytes]) -> None:
    """Closes what an `open` that failed had opened, without raising."""
    if database is not None:
        with contextlib.suppress(Exception):
            database.close(checkpoint=False)
    lock_file.close()
