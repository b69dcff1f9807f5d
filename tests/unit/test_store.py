"""The durable job store: round trips, state rules, streamed results, retention per tenant, space, crash
leftovers, unusable state dirs, and a real SIGKILL."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from services.orchestrator.store import (
    RESULT_FILE,
    SCHEMA_VERSION,
    DuplicateRequestId,
    InvalidTransition,
    JobRecord,
    JobStore,
    MinFree,
    ResultGone,
    StateDirLocked,
    StoreError,
    UnknownJob,
    Usage,
    parse_size,
)
from services.orchestrator.store.models import FORGET_AFTER_S
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2
from tests.helpers.store import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    FakeClock,
    OpenStore,
    delete_file,
    files,
    read_file,
    write_file,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock, open_store: OpenStore):
    with open_store(tmp_path / "state", clock=clock) as opened:
        yield opened


def _request(i: int, request_id: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="tiny", prompt=f"prompt {i}", height=64, width=64, num_frames=9, seed=i, fps=16, request_id=request_id
    )


def _add(store: JobStore, job_id: str, tenant: str = "acme", request_id: str = "", **fields) -> JobRecord:
    record = JobRecord.new(job_id, tenant, _request(len(job_id), request_id), **fields)
    return store.insert(record)


def _frames(count: int, value: int = 7) -> np.ndarray:
    frames = np.full((count, 8, 16, 3), value, np.uint8)
    frames[:, 0, 0, 0] = np.arange(count)
    return frames


def _chunks(name: str, value: np.ndarray, **options) -> list[tensor_pb2.TensorChunk]:
    return list(encode_tensor(name, value, **options))


def test_record_round_trip(store: JobStore, clock: FakeClock) -> None:
    inserted = _add(store, "job-1", "acme", "req-1", priority="high", deadline_at=2000.0)
    assert inserted.seq == 1 and inserted.created_at == clock.now
    loaded = store.get("job-1")
    assert loaded == inserted
    assert loaded.parse_request() == _request(len("job-1"), "req-1")
    assert (loaded.state, loaded.priority, loaded.deadline_at, loaded.attempts) == (QUEUED, "high", 2000.0, 0)
    assert store.get("missing") is None


def test_request_ids_are_unique_per_tenant(store: JobStore) -> None:
    _add(store, "a1", "acme", "same")
    _add(store, "b1", "beta", "same")  # another tenant may use the same id
    _add(store, "a2", "acme")
    _add(store, "a3", "acme")  # no request id: never a duplicate
    with pytest.raises(DuplicateRequestId) as duplicate:
        _add(store, "a4", "acme", "same")
    assert duplicate.value.job_id == "a1"
    assert store.find_by_request_id("acme", "same").job_id == "a1"
    assert store.find_by_request_id("beta", "same").job_id == "b1"
    assert store.find_by_request_id("acme", "other") is None and store.find_by_request_id("acme", "") is None
    with pytest.raises(StoreError, match="already stored"):
        _add(store, "a1", "acme")
    with pytest.raises(ValueError, match="job_id"):
        _add(store, "../escape", "acme")


def test_state_transitions(store: JobStore, clock: FakeClock) -> None:
    _add(store, "j")
    clock.now = 1010.0
    running = store.update_state("j", RUNNING)
    assert (running.state, running.started_at, running.attempts) == (RUNNING, 1010.0, 1)
    requeued = store.update_state("j", QUEUED)  # recovery after a restart
    assert (requeued.state, requeued.started_at) == (QUEUED, None)
    store.update_state("j", RUNNING)
    with pytest.raises(InvalidTransition, match="JOB_STATE_RUNNING"):
        store.update_state("j", RUNNING)
    with pytest.raises(InvalidTransition, match="commit_result"):
        store.update_state("j", SUCCEEDED)
    clock.now = 1030.0
    failed = store.update_state(
        "j", FAILED, error_code=14, error_message="vae unavailable", timings={"dit": 1.5}, fps_out=16.0
    )
    assert (failed.state, failed.finished_at, failed.error_code, failed.error_message) == (
        FAILED,
        1030.0,
        14,
        "vae unavailable",
    )
    assert failed.timings == {"dit": 1.5} and failed.attempts == 2 and failed.fps_out == 16.0
    with pytest.raises(InvalidTransition, match="JOB_STATE_FAILED"):
        store.update_state("j", CANCELLED)
    with pytest.raises(UnknownJob):
        store.update_state("nope", RUNNING)
    _add(store, "q")
    assert store.update_state("q", CANCELLED, error_code=1).state == CANCELLED  # cancelled while queued


def test_recoverable_lists_unfinished_jobs_in_admission_order(store: JobStore) -> None:
    for name in ["c", "a", "d", "b"]:
        _add(store, name, tenant=name)
    store.update_state("a", RUNNING)
    store.update_state("d", RUNNING)
    store.update_state("d", CANCELLED)
    assert [(r.job_id, r.state) for r in store.recoverable()] == [("c", QUEUED), ("a", RUNNING), ("b", QUEUED)]


def test_listing_filters_and_pages(store: JobStore) -> None:
    for i in range(6):
        _add(store, f"j{i}", tenant="acme" if i % 2 else "beta")
    for i in (1, 2, 3):
        store.update_state(f"j{i}", RUNNING)
    store.update_state("j1", FAILED)
    store.save_result("j2", _frames(1), 8.0)
    assert [r.job_id for r in store.list_jobs()] == ["j5", "j4", "j3", "j2", "j1", "j0"]
    assert [r.job_id for r in store.list_jobs(tenant="acme", limit=2)] == ["j5", "j3"]
    page = store.list_jobs(limit=2)
    assert [r.job_id for r in store.list_jobs(limit=2, before_seq=page[-1].seq)] == ["j3", "j2"]
    assert [r.job_id for r in store.list_jobs(states=[RUNNING, QUEUED])] == ["j5", "j4", "j3", "j0"]
    assert [r.job_id for r in store.finished_jobs()] == ["j2", "j1"]
    assert [r.job_id for r in store.finished_jobs(tenant="beta")] == ["j2"]


def test_intermediates_round_trip_as_the_chunks_the_stages_sent(store: JobStore) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 0, 0, 0]], dtype=np.int64)
    # What a text encoder sends: each text's tensors in several chunks; bf16 travels as its uint16 bits.
    conditioning = [
        *_chunks("prompt_embeds", rng.standard_normal((1, 5, 8), dtype=np.float32), chunk_bytes=48),
        *_chunks("prompt_embeds_mask", mask),
        *_chunks("negative_prompt_embeds", rng.integers(0, 2**16, (1, 5, 8), dtype=np.uint16), datatype="BF16"),
    ]
    assert store.mark_stage_done("j", "text-encoder", conditioning)
    latents = [chunk for t in (0, 1, 2) for chunk in _chunks("latents", rng.standard_normal((1, 4, 1, 2, 2)), index=t)]
    assert store.mark_stage_done("j", "dit", latents)
    assert store.get("j").last_stage == "dit"
    loaded = store.load_intermediates("j")
    assert list(loaded) == ["text-encoder", "dit"]
    # The same messages, in the order they were sent: headers, offsets and bytes.
    assert loaded == {"text-encoder": conditioning, "dit": latents}
    assert len(conditioning) > 3
    with pytest.raises(ValueError, match="stage"):
        store.mark_stage_done("j", "../x", [])


def test_an_unreadable_saved_output_is_a_store_error_naming_the_stage(store: JobStore) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    store.mark_stage_done("j", "dit", _chunks("latents", np.ones((1, 4, 1, 8, 8), np.float32)))
    write_file(store, "j", "stage-dit.chunks", read_file(store, "j", "stage-dit.chunks")[:-7])
    with pytest.raises(StoreError, match="job j: the saved output of stage dit cannot be read"):
        store.load_intermediates("j")


def test_finishing_a_job_drops_its_intermediates(store: JobStore) -> None:
    for job_id in ("ok", "bad"):
        _add(store, job_id)
        store.update_state(job_id, RUNNING)
        store.mark_stage_done(job_id, "text-encoder", _chunks("prompt_embeds", np.ones((1, 2), np.float32)))
    assert files(store) == ["bad/stage-text-encoder.chunks", "ok/stage-text-encoder.chunks"]
    store.save_result("ok", _frames(3), 16.0)
    store.update_state("bad", FAILED, error_code=13)
    assert files(store) == [f"ok/{RESULT_FILE}"]
    assert store.load_intermediates("ok") == {} and store.load_intermediates("bad") == {}
    # A stage that ends after its job was cancelled keeps nothing.
    assert store.mark_stage_done("bad", "dit", _chunks("latents", np.ones(1, np.float32))) is False
    assert files(store) == [f"ok/{RESULT_FILE}"]


def _assemble(events) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The frames and the (first, count) pieces a watcher assembles from result events."""
    assembler = TensorAssembler()
    pieces, arrays = [], []
    for event in events:
        if event.HasField("result"):
            tensor = assembler.feed(event.result.tensor)
            if tensor is not None:
                pieces.append((tensor.index, tensor.array.shape[0]))
                arrays.append(tensor.array)
    assembler.finish()
    return np.concatenate(arrays), pieces


def test_result_round_trip_and_replay(store: JobStore, clock: FakeClock) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    frames = _frames(9)
    pieces = [(0, 1), (1, 4), (5, 4)]  # the VAE's chunks: one frame, then four per latent frame
    clock.now = 1100.0
    record = store.save_result("j", frames, 16.0, pieces=pieces, timings={"total": 3.0})
    assert (record.state, record.finished_at, record.num_frames_out, record.fps_out) == (SUCCEEDED, 1100.0, 9, 16.0)
    assert record.timings == {"total": 3.0}
    result = store.load_result("j")
    assert np.array_equal(result.frames, frames) and result.pieces == pieces and result.fps == 16.0
    replay = list(result.events("j", chunk_bytes=500))
    assert all(event.job_id == "j" for event in replay)
    completed = replay[-1].completed
    assert (completed.num_frames, completed.fps, dict(completed.timings)) == (9, 16.0, {"total": 3.0})
    # A watcher after a restart assembles exactly the frames and the pieces it would have seen live, in the
    # very chunks `encode_tensor` makes.
    again, again_pieces = _assemble(replay)
    assert np.array_equal(again, frames) and again_pieces == pieces
    expected = [
        c
        for first, n in pieces
        for c in encode_tensor("frames", frames[first : first + n], index=first, chunk_bytes=500)
    ]
    assert [event.result.tensor for event in replay[:-1]] == expected
    with pytest.raises(InvalidTransition):
        store.save_result("j", frames, 16.0)


def test_a_result_streams_into_its_file_and_is_read_back_while_written(store: JobStore) -> None:
    _add(store, "j", "acme")
    store.update_state("j", RUNNING)
    frames = _frames(9)
    writer = store.create_result("j", frames.shape)
    (partial,) = [name for name in files(store)]
    assert partial.startswith("j/.") and partial.endswith(".partial")
    assert (store.jobs_dir / partial).stat().st_size == writer.nbytes  # preallocated
    reader = writer.open_reader()
    for first, count in [(0, 1), (1, 4)]:
        data = frames[first : first + count].reshape(-1)
        writer.write(first, 0, data[:100])
        writer.write(first, 100, data[100:])
        writer.add_piece(first, count)
    # Followers of the running job read what is written, in the chunks encode_tensor would make.
    assert list(reader.chunks(1, 4, chunk_bytes=300)) == list(
        encode_tensor("frames", frames[1:5], index=1, chunk_bytes=300)
    )
    assert store.usage("acme") == Usage(finished=0, active=0)  # a partial file is not a stored result yet
    with pytest.raises(ValueError, match="gaps"):
        store.commit_result(writer, 16.0)  # frames 5..8 are missing
    writer.write(5, 0, frames[5:].reshape(-1))
    writer.add_piece(5, 4)
    with pytest.raises(ValueError, match="do not fit"):
        writer.write(8, 1, frames[8].reshape(-1))  # past the end
    record = store.commit_result(writer, 16.0, timings={"total": 1.0})
    assert record.state == SUCCEEDED and files(store) == [f"j/{RESULT_FILE}"]
    # A reader opened while the job ran keeps reading after the rename; a new one opens the final file.
    assert list(reader.chunks(5, 4)) == list(encode_tensor("frames", frames[5:], index=5))
    reader.close()
    with writer.open_reader() as late:
        assert list(late.chunks(0, 1)) == list(encode_tensor("frames", frames[:1], index=0))
    assert store.usage("acme") == Usage(finished=writer.nbytes, active=0)
    assert np.array_equal(store.load_result("j").frames, frames)
    assert store.load_result("j").pieces == [(0, 1), (1, 4), (5, 4)]


def test_a_discarded_or_crashed_result_leaves_nothing(tmp_path: Path, open_store: OpenStore) -> None:
    with open_store(tmp_path) as store:
        for job_id in ("failed", "crashed"):
            _add(store, job_id)
            store.update_state(job_id, RUNNING)
        writer = store.create_result("failed", (2, 8, 16, 3))
        writer.write(0, 0, _frames(1).reshape(-1))
        reader = writer.open_reader()
        writer.discard()
        store.update_state("failed", FAILED, error_code=14)
        # A follower that had the file open finishes its read; a new one finds nothing.
        assert list(reader.chunks(0, 1))[0].data == _frames(1).tobytes()
        reader.close()
        with pytest.raises(ResultGone):
            writer.open_reader()
        store.create_result("crashed", (2, 8, 16, 3)).write(0, 0, _frames(2).reshape(-1))
        assert [name.split("/")[0] for name in files(store)] == ["crashed"]
    # The process died before the commit: the next open sweeps the partial file, and the job has no result.
    with open_store(tmp_path) as store:
        assert files(store) == [] and store.load_result("crashed") is None
        with pytest.raises(InvalidTransition, match="not JOB_STATE_RUNNING"):
            store.create_result("failed", (2, 8, 16, 3))


def test_bad_results_are_refused(store: JobStore) -> None:
    _add(store, "j")
    with pytest.raises(InvalidTransition, match="not JOB_STATE_RUNNING"):
        store.save_result("j", _frames(2), 16.0)  # still queued
    store.update_state("j", RUNNING)
    with pytest.raises(ValueError, match="uint8"):
        store.save_result("j", np.zeros((2, 8, 8, 3), np.float32), 16.0)
    with pytest.raises(ValueError, match="gaps or overlaps"):
        store.save_result("j", _frames(4), 16.0, pieces=[(0, 2), (3, 1)])
    with pytest.raises(ValueError, match="shape"):
        store.create_result("j", (2, 8, 8, 4))
    store.update_state("j", CANCELLED)
    with pytest.raises(InvalidTransition):
        store.save_result("j", _frames(2), 16.0)
    assert files(store) == [] and store.load_result("j") is None


def test_a_changed_result_file_is_an_error_not_a_replay(store: JobStore) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    store.save_result("j", _frames(3), 16.0)
    write_file(store, "j", RESULT_FILE, read_file(store, "j", RESULT_FILE)[:-1])  # truncated
    with pytest.raises(StoreError, match="does not hold the frames"):
        store.load_result("j")
    delete_file(store, "j", RESULT_FILE)
    with pytest.raises(StoreError, match="cannot be read"):
        store.load_result("j")


def test_prune_and_delete(store: JobStore, clock: FakeClock) -> None:
    for i in range(5):
        _add(store, f"j{i}")
        store.update_state(f"j{i}", RUNNING)
        clock.now += 10
        store.save_result(f"j{i}", _frames(1), 8.0)
    _add(store, "live")
    store.update_state("live", RUNNING)
    assert store.prune(max_kept=3) == ["j0", "j1"]
    assert files(store) == [f"j{i}/{RESULT_FILE}" for i in (2, 3, 4)]
    # j2 finished at 1030, j3 at 1040, j4 at 1050 = now.
    assert store.prune(max_age_s=5) == ["j2", "j3"]
    assert store.get("live") is not None and store.get("j3") is None
    with pytest.raises(InvalidTransition, match="finish it"):
        store.delete("live")
    assert store.delete("j4") is True and store.delete("j4") is False
    assert files(store) == [] and [r.job_id for r in store.list_jobs()] == ["live"]


def _finish(store: JobStore, clock: FakeClock, job_id: str, tenant: str, frames: int = 1) -> int:
    """A succeeded job of `tenant` with a result of `frames` frames, finished one second after the last;
    returns the result file's size."""
    _add(store, job_id, tenant)
    store.update_state(job_id, RUNNING)
    clock.now += 1
    store.save_result(job_id, _frames(frames), 8.0)
    return len(read_file(store, job_id, RESULT_FILE))


def test_prune_keeps_each_tenant_within_its_own_limits(store: JobStore, clock: FakeClock) -> None:
    for i in range(2):
        _finish(store, clock, f"b{i}", "beta")
    size = 0
    for i in range(5):
        size = _finish(store, clock, f"a{i}", "acme")
    # acme finishing many jobs deletes only acme's oldest: beta's older jobs and request ids stay.
    assert store.prune(tenant="acme", max_kept=3) == ["a0", "a1"]
    assert store.prune(max_kept=2) == ["a2"]  # every tenant against its own count
    assert sorted(r.job_id for r in store.finished_jobs()) == ["a3", "a4", "b0", "b1"]
    assert store.usage("acme") == Usage(finished=2 * size, active=0)
    assert store.tenants() == ["acme", "beta"]

    # Bytes: the files of acme's running job and what it will still write count first, then its newest results.
    _add(store, "a-running", "acme")
    store.update_state("a-running", RUNNING)
    store.mark_stage_done("a-running", "text-encoder", _chunks("prompt_embeds", np.ones(8, np.float32)))
    embeds = store.usage("acme").active
    assert embeds > 0
    assert store.prune(tenant="acme", max_bytes=embeds + 2 * size) == []
    assert store.prune(tenant="acme", max_bytes=embeds + 2 * size, reserved_bytes=1) == ["a3"]
    assert store.prune(tenant="acme", max_bytes=embeds + size, reserved_bytes=size) == ["a4"]
    assert store.get("a-running").state == RUNNING  # running jobs are never pruned
    assert store.usage("beta") == Usage(finished=2 * size, active=0)
    with pytest.raises(ValueError, match="reserved_bytes"):
        store.prune(max_bytes=1, reserved_bytes=1)

    # Age: jobs of every tenant that finished too long ago.
    clock.now += 100
    _finish(store, clock, "b-new", "beta")
    assert store.prune(max_age_s=50) == ["b0", "b1"]
    assert [r.job_id for r in store.finished_jobs()] == ["b-new"]


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_state_dir_is_migrated(tmp_path: Path, version: int) -> None:
    """Version 1 lacked the sizes (the files are measured); versions 1 and 2 kept stage outputs as safetensors
    files of decoded tensors, which are dropped: the job they belong to runs again from its first stage."""
    with JobStore.open(tmp_path) as store:
        clock_free = FakeClock()
        store.clock = clock_free
        size = _finish(store, clock_free, "done", "acme", frames=3)
        _add(store, "running", "acme")
        store.update_state("running", RUNNING)
    old_output = tmp_path / "jobs" / "running" / "stage-text-encoder.safetensors"
    old_output.parent.mkdir()
    old_output.write_bytes(b"safetensors of the text encoder's embeddings")
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:  # what the older version wrote
        db.execute(
            "INSERT INTO intermediates (job_id, stage, file, done_at, bytes) VALUES (?, ?, ?, ?, ?)",
            ("running", "text-encoder", old_output.name, 1.0, old_output.stat().st_size),
        )
        db.execute("UPDATE jobs SET last_stage = 'text-encoder' WHERE job_id = 'running'")
        _drop_pass_counts(db)
        if version == 1:
            db.execute("DROP INDEX jobs_by_tenant")
            db.execute("ALTER TABLE results DROP COLUMN bytes")
            db.execute("ALTER TABLE intermediates DROP COLUMN bytes")
        db.execute(f"PRAGMA user_version = {version}")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.usage("acme") == Usage(finished=size, active=0)
        assert np.array_equal(store.load_result("done").frames, _frames(3))
        assert store.load_intermediates("running") == {} and store.get("running").last_stage == ""
        assert [r.job_id for r in store.recoverable()] == ["running"]
        assert files(store) == [f"done/{RESULT_FILE}"]


def _drop_pass_counts(db: sqlite3.Connection) -> None:
    """The jobs table as versions 1 to 3 had it, without the DiT's pass counts (and results as before 5)."""
    db.execute("ALTER TABLE jobs DROP COLUMN passes_run")
    db.execute("ALTER TABLE jobs DROP COLUMN passes_skipped")
    _drop_encoded_results(db)


def _drop_encoded_results(db: sqlite3.Connection) -> None:
    """The results table as versions 1 to 4 had it, without encoded files (and jobs as before 6)."""
    for column in ("media_type", "encoded_file", "encoded_bytes", "raw_kept"):
        db.execute(f"ALTER TABLE results DROP COLUMN {column}")
    _drop_leases(db)


def _drop_leases(db: sqlite3.Connection) -> None:
    """The tables as versions 1 to 5 had them: jobs without owners and leases, stage outputs without positions
    (and jobs as before 7)."""
    for column in ("owner", "lease_epoch", "lease_until"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    db.execute("ALTER TABLE intermediates DROP COLUMN position")
    _drop_notices(db)


def _drop_notices(db: sqlite3.Connection) -> None:
    """The jobs table as versions 1 to 6 had it, without notices (and results as before 8)."""
    db.execute("ALTER TABLE jobs DROP COLUMN notices")
    _drop_sound(db)


def _drop_sound(db: sqlite3.Connection) -> None:
    """The results table as versions 1 to 7 had it, without a result's sound (and jobs as before 9)."""
    for column in ("audio_file", "audio_shape", "audio_rate"):
        db.execute(f"ALTER TABLE results DROP COLUMN {column}")
    _drop_preemptions(db)


def _drop_preemptions(db: sqlite3.Connection) -> None:
    """The jobs table as versions 1 to 8 had it, without preemption counts."""
    db.execute("ALTER TABLE jobs DROP COLUMN preemptions")


def test_version_3_gains_pass_counts_and_keeps_stage_outputs(tmp_path: Path) -> None:
    """Version 3 kept stage outputs as version 4 does: they stay, and the jobs count no passes until their
    DiT reports some."""
    chunks = [tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="latents"), data=b"latents")]
    with JobStore.open(tmp_path) as store:
        _add(store, "running", "acme")
        store.update_state("running", RUNNING)
        store.mark_stage_done("running", "text-encoder", chunks)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_pass_counts(db)
        db.execute("PRAGMA user_version = 3")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.load_intermediates("running") == {"text-encoder": chunks}
        record = store.get("running")
        assert (record.passes_run, record.passes_skipped) == (0, 0)
        store.mark_stage_done("running", "dit", chunks, passes=(7, 5))
        record = store.get("running")
        assert (record.passes_run, record.passes_skipped, record.last_stage) == (7, 5, "dit")


def test_version_4_results_stay_readable_as_raw_frames(tmp_path: Path) -> None:
    """Version 4 stored raw frames only: its results load and replay as raw, and new jobs may store encoded ones."""
    with JobStore.open(tmp_path) as store:
        clock_free = FakeClock()
        store.clock = clock_free
        size = _finish(store, clock_free, "done", "acme", frames=3)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_encoded_results(db)
        db.execute("PRAGMA user_version = 4")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert files(store) == [f"done/{RESULT_FILE}"]
        result = store.load_result("done")
        assert result.path == store.jobs_dir / "done" / RESULT_FILE and np.array_equal(result.frames, _frames(3))
        assert (result.media_type, result.encoded_path, result.encoded_bytes) == ("", None, 0)
        assert store.usage("acme") == Usage(finished=size, active=0)
        *chunks, completed = result.events("done", seed=3)
        assert [event.result.tensor for event in chunks] == _chunks("frames", _frames(3), index=0)
        assert (completed.completed.media_type, completed.completed.encoded_bytes) == ("", 0)
        # The new columns are there: a job finishing now keeps an encoded result.
        _add(store, "new", "acme")
        store.update_state("new", RUNNING)
        writer = store.create_result("new", (1, 8, 16, 3))
        writer.write(0, 0, _frames(1).reshape(-1))
        writer.add_piece(0, 1)
        encoded = store.create_encoded("new", ".png", "image/png")
        encoded.append(b"png bytes")
        store.commit_result(writer, 8.0, encoded=encoded, keep_raw=False)
        assert (store.load_result("new").media_type, store.load_result("new").path) == ("image/png", None)
        assert store.usage("acme") == Usage(finished=size + len(b"png bytes"), active=0)


def test_sizes_and_free_space_on_flags() -> None:
    assert parse_size("1073741824") == 1 << 30
    assert parse_size("1GiB") == parse_size("1G") == parse_size("1 gb") == 1 << 30
    assert parse_size("1.5MiB") == 3 << 19 and parse_size("512K") == 512 << 10
    for wrong in ("", "-1", "1X", "GiB", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(wrong)
    assert MinFree.parse("1GiB").of(10 << 30) == 1 << 30
    assert MinFree.parse("5%").of(1000) == 50 and str(MinFree.parse("5%")) == "5%"
    for wrong in ("100%", "-1%", "x%"):
        with pytest.raises(ValueError, match="percentage"):
            MinFree.parse(wrong)


def test_one_process_owns_the_state_dir(tmp_path: Path) -> None:
    first = JobStore.open(tmp_path)
    with pytest.raises(StateDirLocked):
        JobStore.open(tmp_path)
    first.close()
    with pytest.raises(StoreError, match="closed"):
        first.get("x")
    with JobStore.open(tmp_path, synchronous="FULL") as second:
        db = second._connection()
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with JobStore.open(tmp_path) as third:
        assert third._connection().execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with pytest.raises(ValueError, match="synchronous"):
        JobStore.open(tmp_path, synchronous="OFF")


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    JobStore.open(tmp_path).close()
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="schema version 99"):
        JobStore.open(tmp_path)
    JobStore.open(tmp_path / "other").close()  # the failed open released its lock
    with pytest.raises(StoreError, match="schema version 99"):
        JobStore.open(tmp_path)


def _open_as(uid: int, state_dir: Path) -> str:
    """What JobStore.open says when another user opens `state_dir` (a forked child that drops root)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child touches only the file system, then exits at once
        try:
            os.setgid(uid)
            os.setuid(uid)
            try:
                JobStore.open(state_dir).close()
                message = "opened"
            except StoreError as error:
                message = str(error)
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_an_unusable_state_dir_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    for state_dir in (blocker, blocker / "state"):
        with pytest.raises(StoreError, match="cannot be used as the state dir") as raised:
            JobStore.open(state_dir)
        assert "\n" not in str(raised.value) and "Errno" not in str(raised.value)
    (tmp_path / "jobs-is-a-file").mkdir()
    (tmp_path / "jobs-is-a-file" / "jobs").write_text("")
    with pytest.raises(StoreError, match="cannot be used as the state dir"):
        JobStore.open(tmp_path / "jobs-is-a-file")

    # A directory the server's user may not write, as a fresh root-owned volume is for the container's user.
    # Root may write anywhere, so as root the open runs as another user; otherwise the directory is read-only.
    parent = Path(tempfile.mkdtemp(prefix="stagediff-readonly-"))
    try:
        locked = parent / "state"
        locked.mkdir()
        if os.geteuid() == 0:
            parent.chmod(0o755)
            message = _open_as(65534, locked / "sub")
        else:
            locked.chmod(0o555)
            with pytest.raises(StoreError) as raised:
                JobStore.open(locked / "sub")
            message = str(raised.value)
        assert message.startswith("cannot be used as the state dir: Permission denied"), message
        assert "\n" not in message and str(locked / "sub") in message
    finally:
        locked.chmod(0o755)
        shutil.rmtree(parent)


def test_open_sweeps_what_a_crash_leaves(tmp_path: Path, open_store: OpenStore) -> None:
    with open_store(tmp_path) as store:
        _add(store, "done")
        store.update_state("done", RUNNING)
        store.save_result("done", _frames(2), 16.0)
        _add(store, "running")
        store.update_state("running", RUNNING)
        store.mark_stage_done("running", "text-encoder", _chunks("prompt_embeds", np.ones(3, np.float32)))
        jobs = store.jobs_dir
    # What a crash can leave: a half-written temporary file, a complete file whose
    # row was never committed, and the folder of a job whose insert never committed.
    (jobs / "running" / f".{RESULT_FILE}.abc.tmp").write_bytes(b"\x93NUMPY partial")
    np.save(jobs / "running" / RESULT_FILE, _frames(2))
    (jobs / "running" / "stage-dit.chunks").write_bytes(b"not committed")
    (jobs / "ghost").mkdir()
    (jobs / "ghost" / RESULT_FILE).write_bytes(b"x")
    with open_store(tmp_path) as store:
        assert files(store) == [f"done/{RESULT_FILE}", "running/stage-text-encoder.chunks"]
        assert store.load_result("running") is None
        assert list(store.load_intermediates("running")) == ["text-encoder"]
        assert [r.job_id for r in store.recoverable()] == ["running"]
        assert np.array_equal(store.load_result("done").frames, _frames(2))


def test_calls_from_several_threads(tmp_path: Path, open_store: OpenStore) -> None:
    """One connection behind a lock: record calls on one thread, file calls on worker threads."""
    errors: list[BaseException] = []
    with open_store(tmp_path) as store:

        def work(worker: int) -> None:
            try:
                for i in range(15):
                    job_id = f"w{worker}-{i}"
                    _add(store, job_id, tenant=f"t{worker}", request_id=f"r{i}")
                    store.update_state(job_id, RUNNING)
                    store.mark_stage_done(job_id, "text-encoder", _chunks("prompt_embeds", np.full(4, float(i))))
                    if i % 3:
                        store.save_result(job_id, _frames(2, value=worker), 16.0)
                    else:
                        store.update_state(job_id, FAILED, error_code=14)
                    store.list_jobs(limit=5)
            except BaseException as error:  # reported below, on the test's thread
                errors.append(error)

        threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(store.finished_jobs(limit=1000)) == 60 and store.recoverable() == []
        for worker in range(4):
            assert len(store.list_jobs(states=[SUCCEEDED], tenant=f"t{worker}")) == 10
            assert np.array_equal(store.load_result(f"w{worker}-1").frames, _frames(2, value=worker))
        assert not any("stage-" in name for name in files(store))


def test_version_5_jobs_gain_owners_and_leases(tmp_path: Path) -> None:
    """Version 5 had no owners or leases: its jobs are owned by none, at epoch 0, until claimed again."""
    with JobStore.open(tmp_path) as store:
        _add(store, "queued", "acme")
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_leases(db)
        db.execute("PRAGMA user_version = 5")
    with JobStore.open(tmp_path) as store:
        connection = store._connection()
        assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        row = connection.execute("SELECT owner, lease_epoch, lease_until FROM jobs WHERE job_id = 'queued'").fetchone()
        assert tuple(row) == ("", 0, None)
        assert store.get("queued").tenant == "acme"


TRUNCATED = stages_pb2.Notice(
    field="prompt", given="721 tokens", used="512 tokens", message="the prompt was truncated", source="text-encoder"
)
CLAMPED = stages_pb2.Notice(field="seconds", given="100 s", used="16.06 s", message="clamped", source="http")


def test_notices_are_kept_with_the_job_and_its_result(store: JobStore, clock: FakeClock) -> None:
    """A job's notices: those it was admitted with, then a stage's while it runs (never once it has finished),
    read back with the job and replayed with its stored result."""
    _add(store, "job", notices=[CLAMPED])
    assert store.get("job").notices == [CLAMPED]
    store.update_state("job", RUNNING)
    assert store.set_notices("job", [CLAMPED, TRUNCATED])
    clock.now += 1
    store.save_result("job", _frames(1), 8.0)
    assert store.get("job").notices == [CLAMPED, TRUNCATED]
    assert not store.set_notices("job", [])
    *_, completed = store.load_result("job").events("job")
    assert list(completed.completed.notices) == [CLAMPED, TRUNCATED]


def test_version_6_jobs_gain_notices(tmp_path: Path) -> None:
    """Version 6 had no notices: its jobs have none, and a running one takes a stage's."""
    with JobStore.open(tmp_path) as store:
        _add(store, "running", "acme")
        store.update_state("running", RUNNING)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_notices(db)
        db.execute("PRAGMA user_version = 6")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.get("running").notices == []
        assert store.set_notices("running", [TRUNCATED]) and store.get("running").notices == [TRUNCATED]


def test_version_7_results_are_silent(tmp_path: Path) -> None:
    """Version 7 kept no sound: its results read back silent, and a new result keeps its sound."""
    with JobStore.open(tmp_path) as store:
        clock = FakeClock()
        store.clock = clock
        _finish(store, clock, "done", "acme", frames=3)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_sound(db)
        db.execute("PRAGMA user_version = 7")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        result = store.load_result("done")
        assert result.audio is None and np.array_equal(result.frames, _frames(3))
        _add(store, "loud", "acme")
        store.update_state("loud", RUNNING)
        writer = store.create_result("loud", (1, 4, 4, 3))
        writer.write(0, 0, np.zeros(48, np.uint8))
        writer.add_piece(0, 1)
        sound = np.linspace(-1, 1, 2 * 100, dtype=np.float32).reshape(2, 100)
        store.commit_result(writer, 16.0, audio=store.create_audio("loud", sound, 24000))
        assert np.array_equal(store.load_result("loud").audio, sound) and store.load_result("loud").audio_rate == 24000


def test_version_8_jobs_count_no_preemptions_until_one(tmp_path: Path) -> None:
    """Version 8 counted no preemptions: its jobs have none, and a running one counts each from then on."""
    with JobStore.open(tmp_path) as store:
        _add(store, "running", "acme")
        store.update_state("running", RUNNING)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        _drop_preemptions(db)
        db.execute("PRAGMA user_version = 8")
    with JobStore.open(tmp_path) as store:
        assert store._connection().execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 9
        assert store.get("running").preemptions == 0
        assert store.count_preemption("running") and store.count_preemption("running")
        assert store.get("running").preemptions == 2
        store.update_state("running", CANCELLED)
        assert not store.count_preemption("running") and store.get("running").preemptions == 2


def test_served_models_are_kept_until_no_dit_reports_them_for_a_week(tmp_path: Path, open_store: OpenStore) -> None:
    with open_store(tmp_path / "state") as store:
        store.models.save("wan", b"first", 1000.0)
        store.models.save("qwen", b"qwen", 1000.0)
        store.models.save("wan", b"changed", 2000.0)  # a DiT reported it again, changed
    with open_store(tmp_path / "state") as reopened:
        assert [(m.model, m.info, m.seen_at) for m in reopened.models.load(2000.0)] == [
            ("qwen", b"qwen", 1000.0),
            ("wan", b"changed", 2000.0),
        ]
        assert [m.model for m in reopened.models.load(1000.0 + FORGET_AFTER_S + 1)] == ["wan"]
