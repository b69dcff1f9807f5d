"""The job database's tables, and the migrations that bring an older state directory's database up to date.

`migrate` runs once when a store opens, in one transaction: a new database gets `SCHEMA`, an older one each
step from its `PRAGMA user_version` up to `SCHEMA_VERSION`; a newer one is refused. A schema change adds a
step here and raises `SCHEMA_VERSION`; a step never edits an earlier one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from services.orchestrator.store.database import Database
from services.orchestrator.store.models import SQLITE_TABLE as MODELS_TABLE
from services.orchestrator.store_errors import StoreError

SCHEMA_VERSION = 9

SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- admission order
    job_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    request_id TEXT,                        -- NULL when the client gave none
    priority TEXT NOT NULL,
    request BLOB NOT NULL,                  -- GenerateRequest, serialized
    state INTEGER NOT NULL,                 -- JobState value
    created_at REAL NOT NULL,               -- unix seconds, as are all times
    started_at REAL,
    finished_at REAL,
    deadline_at REAL,
    error_code INTEGER,                     -- google.rpc.Code value
    error_message TEXT NOT NULL DEFAULT '',
    timings TEXT NOT NULL DEFAULT '{}',     -- JSON {stage: seconds}
    num_frames_out INTEGER NOT NULL DEFAULT 0,
    fps_out REAL NOT NULL DEFAULT 0,
    last_stage TEXT NOT NULL DEFAULT '',    -- last stage whose output is saved
    attempts INTEGER NOT NULL DEFAULT 0,    -- times the job was started
    passes_run INTEGER NOT NULL DEFAULT 0,  -- transformer passes the DiT ran in full
    passes_skipped INTEGER NOT NULL DEFAULT 0,  -- and those its step cache skipped
    owner TEXT NOT NULL DEFAULT '',         -- the replica running the job ('' while queued)
    lease_epoch INTEGER NOT NULL DEFAULT 0, -- +1 per claim: fences a former owner's writes
    lease_until REAL,                       -- until when the owner's lease lasts
    notices TEXT NOT NULL DEFAULT '[]',     -- JSON [Notice]: changes made to the request (orchestrator/notices.py)
    preemptions INTEGER NOT NULL DEFAULT 0, -- times the job yielded its DiT slot to a higher class
    UNIQUE (tenant, request_id)
);
CREATE INDEX jobs_by_state ON jobs (state, seq);
CREATE INDEX jobs_by_tenant ON jobs (tenant, state, finished_at);
CREATE TABLE intermediates (
    job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    stage TEXT NOT NULL,
    file TEXT NOT NULL,
    done_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,       -- the file's size
    position INTEGER NOT NULL DEFAULT 0,    -- 1, 2, ... in the order the job's stages finished
    PRIMARY KEY (job_id, stage)
);
CREATE TABLE results (
    job_id TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    file TEXT NOT NULL,
    shape TEXT NOT NULL,                    -- JSON [F, H, W, 3]
    fps REAL NOT NULL,
    pieces TEXT NOT NULL,                   -- JSON [[first frame, count], ...] as first published
    saved_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,       -- the files' sizes together
    media_type TEXT NOT NULL DEFAULT '',    -- of the encoded file, '' for a raw result
    encoded_file TEXT,                      -- the encoded file (output_format), NULL for a raw result
    encoded_bytes INTEGER NOT NULL DEFAULT 0,
    raw_kept INTEGER NOT NULL DEFAULT 1,    -- 0: an encoded result whose raw frames were not kept
    audio_file TEXT,                        -- the sound's waveform (float32 .npy), NULL for a silent result
    audio_shape TEXT NOT NULL DEFAULT '[]', -- JSON [channels, samples]
    audio_rate INTEGER NOT NULL DEFAULT 0   -- samples per second
);
"""

# Version 1 lacked the sizes and the per-tenant index; `migrate` adds them and measures the files.
MIGRATE_1_TO_2 = """
ALTER TABLE intermediates ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE results ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_tenant ON jobs (tenant, state, finished_at);
"""

# Version 2 kept stage outputs as safetensors files of the tensors the orchestrator decoded; version 3 keeps
# the chunks the stages sent. A job that was running resumes from its first stage (stages are deterministic),
# and the sweep at open removes the old files, which no row names any more.
MIGRATE_2_TO_3 = """
DELETE FROM intermediates;
UPDATE jobs SET last_stage = '';
"""

# Version 4 counts the transformer passes the DiT ran and skipped (its step cache); older jobs count none.
MIGRATE_3_TO_4 = """
ALTER TABLE jobs ADD COLUMN passes_run INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN passes_skipped INTEGER NOT NULL DEFAULT 0;
"""

# Version 5 stores encoded results (output_format) beside or instead of the raw frames; older results are raw.
MIGRATE_4_TO_5 = """
ALTER TABLE results ADD COLUMN media_type TEXT NOT NULL DEFAULT '';
ALTER TABLE results ADD COLUMN encoded_file TEXT;
ALTER TABLE results ADD COLUMN encoded_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE results ADD COLUMN raw_kept INTEGER NOT NULL DEFAULT 1;
"""

# Version 6 names the replica running a job and its lease (services/orchestrator/store/leases.py); with SQLite
# the one process owns every job, and older jobs are owned by none until claimed again. A stage output's
# position replaces the order SQLite's rowid gave, which PostgreSQL has not.
MIGRATE_5_TO_6 = """
ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN lease_until REAL;
ALTER TABLE intermediates ADD COLUMN position INTEGER NOT NULL DEFAULT 0;
UPDATE intermediates SET position = rowid;
"""

# Version 7 keeps each job's notices, the changes made to its request that its caller did not ask for (a
# truncated prompt); older jobs have none.
MIGRATE_6_TO_7 = """
ALTER TABLE jobs ADD COLUMN notices TEXT NOT NULL DEFAULT '[]';
"""


# Version 8 keeps a result's sound (a model that makes video with sound) beside its frames; older results are silent.
MIGRATE_7_TO_8 = """
ALTER TABLE results ADD COLUMN audio_file TEXT;
ALTER TABLE results ADD COLUMN audio_shape TEXT NOT NULL DEFAULT '[]';
ALTER TABLE results ADD COLUMN audio_rate INTEGER NOT NULL DEFAULT 0;
"""

# Version 9 counts each job's preemptions (services/orchestrator/denoise_call.py); older jobs have none.
MIGRATE_8_TO_9 = """
ALTER TABLE jobs ADD COLUMN preemptions INTEGER NOT NULL DEFAULT 0;
"""


def migrate(database: Database, path: Path, size_of: Callable[[str, str], int]) -> None:
    """Brings the database at `path` to SCHEMA_VERSION. `size_of(job_id, file)`: a job file's size, 0 if absent."""
    with database.transaction() as db:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{path} has schema version {version}; this version reads {SCHEMA_VERSION}")
        if version == 0:
            _run_script(db, SCHEMA)
        if version == 1:
            _run_script(db, MIGRATE_1_TO_2)
            for table in ("intermediates", "results"):
                rows = db.execute(f"SELECT rowid, job_id, file FROM {table}").fetchall()
                for row in rows:
                    size = size_of(row["job_id"], row["file"])
                    db.execute(f"UPDATE {table} SET bytes = ? WHERE rowid = ?", (size, row["rowid"]))
        if version in (1, 2):
            _run_script(db, MIGRATE_2_TO_3)
        if version in (1, 2, 3):
            _run_script(db, MIGRATE_3_TO_4)
        if version in (1, 2, 3, 4):
            _run_script(db, MIGRATE_4_TO_5)
        if version in (1, 2, 3, 4, 5):
            _run_script(db, MIGRATE_5_TO_6)
        if version in (1, 2, 3, 4, 5, 6):
            _run_script(db, MIGRATE_6_TO_7)
        if version in (1, 2, 3, 4, 5, 6, 7):
            _run_script(db, MIGRATE_7_TO_8)
        if version in (1, 2, 3, 4, 5, 6, 7, 8):
            _run_script(db, MIGRATE_8_TO_9)
        if version != SCHEMA_VERSION:
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        _run_script(db, MODELS_TABLE)  # additive, whatever the version (store/models.py)


def _run_script(db: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)
