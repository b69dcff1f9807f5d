"""The durable job store: round trips, state rules, retention, crash leftovers, and a real SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from services.orchestrator.store import (
    RESULT_FILE,
    DuplicateRequestId,
    FrameCollector,
    InvalidTransition,
    JobRecord,
    JobState,
    JobStore,
    StateDirLocked,
    StoreError,
    UnknownJob,
    pack_wire_tensors,
    unpack_wire_tensors,
)
from services.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2

REPO = Path(__file__).resolve().parents[1]
QUEUED, RUNNING = JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock):
    with JobStore.open(tmp_path / "state", clock=clock) as opened:
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


def _files(store: JobStore) -> list[str]:
    return sorted(str(path.relative_to(store.jobs_dir)) for path in store.jobs_dir.rglob("*") if path.is_file())


# --------------------------------------------------------------- records --


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
    with pytest.raises(InvalidTransition, match="save_result"):
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


# --------------------------------------------------------- intermediates --


def test_intermediates_round_trip_in_order(store: JobStore) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    embeds = torch.randn(2, 5, 8).to(torch.bfloat16)
    mask = np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=np.int64)
    assert store.mark_stage_done("j", "text-encoder", {"embeds": embeds, "embeds_mask": mask})
    latents = {f"latents@{t}": torch.randn(1, 4, 1, 2, 2) for t in (0, 1, 2)}
    # Views of one tensor share storage; the store copies them.
    latents["z@0"], latents["a@0"] = torch.arange(6.0)[:3], torch.arange(6.0)[3:]
    assert store.mark_stage_done("j", "dit", latents)
    assert store.get("j").last_stage == "dit"
    loaded = store.load_intermediates("j")
    assert list(loaded) == ["text-encoder", "dit"]
    assert list(loaded["dit"]) == list(latents)  # the order given, not alphabetical
    assert torch.equal(loaded["text-encoder"]["embeds"], embeds)
    assert loaded["text-encoder"]["embeds"].dtype == torch.bfloat16
    assert np.array_equal(loaded["text-encoder"]["embeds_mask"].numpy(), mask)
    for name, tensor in latents.items():
        assert torch.equal(loaded["dit"][name], tensor)
    with pytest.raises(ValueError, match="stage"):
        store.mark_stage_done("j", "../x", {})


def test_finishing_a_job_drops_its_intermediates(store: JobStore) -> None:
    for job_id in ("ok", "bad"):
        _add(store, job_id)
        store.update_state(job_id, RUNNING)
        store.mark_stage_done(job_id, "text-encoder", {"embeds": torch.ones(2)})
    assert _files(store) == ["bad/stage-text-encoder.safetensors", "ok/stage-text-encoder.safetensors"]
    store.save_result("ok", _frames(3), 16.0)
    store.update_state("bad", FAILED, error_code=13)
    assert _files(store) == [f"ok/{RESULT_FILE}"]
    assert store.load_intermediates("ok") == {} and store.load_intermediates("bad") == {}
    # A stage that ends after its job was cancelled keeps nothing.
    assert store.mark_stage_done("bad", "dit", {"latents@0": torch.ones(1)}) is False
    assert _files(store) == [f"ok/{RESULT_FILE}"]


def test_wire_tensors_pack_and_unpack_to_the_same_chunks() -> None:
    chunks = []
    for t in range(3):
        chunks.extend(encode_tensor("latents", torch.randn(1, 16, 1, 8, 8), index=t, chunk_bytes=1000))
    bf16 = list(encode_tensor("other", torch.randn(3).to(torch.bfloat16), index=5))
    packed = pack_wire_tensors(chunks + bf16)
    assert list(packed) == ["latents@0", "latents@1", "latents@2", "other@5"]
    assert packed["other@5"].dtype == torch.bfloat16
    unpacked = unpack_wire_tensors(packed)
    assert pack_wire_tensors(unpacked).keys() == packed.keys()
    assert b"".join(c.data for c in unpacked) == b"".join(c.data for c in chunks + bf16)
    assert [c.header.index for c in unpacked if c.HasField("header")] == [0, 1, 2, 5]


# --------------------------------------------------------------- results --


def _published(frames: np.ndarray, pieces: list[tuple[int, int]], fps: float) -> list[generation_pb2.GenerateEvent]:
    events = [generation_pb2.GenerateEvent(queued=generation_pb2.JobQueued(position=0))]
    for first, count in pieces:
        for chunk in encode_tensor("frames", frames[first : first + count], index=first, chunk_bytes=500):
            events.append(generation_pb2.GenerateEvent(result=generation_pb2.ResultChunk(tensor=chunk, fps=fps)))
    return events


def test_result_round_trip_and_replay(store: JobStore, clock: FakeClock) -> None:
    _add(store, "j")
    store.update_state("j", RUNNING)
    frames = _frames(9)
    pieces = [(0, 1), (1, 4), (5, 4)]  # the VAE's chunks: one frame, then four per latent frame
    # A retried stage published frames 1..4 again; the collector keeps them once.
    events = _published(frames, pieces, 16.0) + _published(frames, [(1, 4)], 16.0)[1:]
    collected, collected_pieces = FrameCollector.from_events(events).result()
    assert np.array_equal(collected, frames) and collected_pieces == pieces
    clock.now = 1100.0
    record = store.save_result("j", collected, 16.0, pieces=collected_pieces, timings={"total": 3.0})
    assert (record.state, record.finished_at, record.num_frames_out, record.fps_out) == (SUCCEEDED, 1100.0, 9, 16.0)
    assert record.timings == {"total": 3.0}
    result = store.load_result("j")
    assert np.array_equal(result.frames, frames) and result.pieces == pieces and result.fps == 16.0
    replay = list(result.events("j"))
    assert all(event.job_id == "j" for event in replay)
    completed = replay[-1].completed
    assert (completed.num_frames, completed.fps, dict(completed.timings)) == (9, 16.0, {"total": 3.0})
    # A watcher after a restart assembles exactly the frames and the pieces it would have seen live.
    again, again_pieces = FrameCollector.from_events(replay).result()
    assert np.array_equal(again, frames) and again_pieces == pieces
    with pytest.raises(InvalidTransition):
        store.save_result("j", frames, 16.0)


def test_bad_results_are_refused(store: JobStore) -> None:
    _add(store, "j")
    with pytest.raises(InvalidTransition, match="not JOB_STATE_RUNNING"):
        store.save_result("j", _frames(2), 16.0)  # still queued
    store.update_state("j", RUNNING)
    with pytest.raises(ValueError, match="uint8"):
        store.save_result("j", np.zeros((2, 8, 8, 3), np.float32), 16.0)
    with pytest.raises(ValueError, match="gaps or overlaps"):
        store.save_result("j", _frames(4), 16.0, pieces=[(0, 2), (3, 1)])
    store.update_state("j", CANCELLED)
    with pytest.raises(InvalidTransition):
        store.save_result("j", _frames(2), 16.0)
    assert _files(store) == [] and store.load_result("j") is None
    collector = FrameCollector()
    for chunk in encode_tensor("frames", _frames(2), index=1):
        collector.feed(chunk)
    with pytest.raises(ValueError, match="gaps"):
        collector.result()  # frame 0 never arrived


# ------------------------------------------------------------- retention --


def test_prune_and_delete(store: JobStore, clock: FakeClock) -> None:
    for i in range(5):
        _add(store, f"j{i}")
        store.update_state(f"j{i}", RUNNING)
        clock.now += 10
        store.save_result(f"j{i}", _frames(1), 8.0)
    _add(store, "live")
    store.update_state("live", RUNNING)
    assert store.prune(max_kept=3) == ["j0", "j1"]
    assert _files(store) == [f"j{i}/{RESULT_FILE}" for i in (2, 3, 4)]
    # j2 finished at 1030, j3 at 1040, j4 at 1050 = now.
    assert store.prune(max_age_s=5) == ["j2", "j3"]
    assert store.get("live") is not None and store.get("j3") is None
    with pytest.raises(InvalidTransition, match="finish it"):
        store.delete("live")
    assert store.delete("j4") is True and store.delete("j4") is False
    assert _files(store) == [] and [r.job_id for r in store.list_jobs()] == ["live"]


# ------------------------------------------------------- the state dir --


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


def test_open_sweeps_what_a_crash_leaves(tmp_path: Path) -> None:
    with JobStore.open(tmp_path) as store:
        _add(store, "done")
        store.update_state("done", RUNNING)
        store.save_result("done", _frames(2), 16.0)
        _add(store, "running")
        store.update_state("running", RUNNING)
        store.mark_stage_done("running", "text-encoder", {"embeds": torch.ones(3)})
        jobs = store.jobs_dir
    # What a crash can leave: a half-written temporary file, a complete file whose
    # row was never committed, and the folder of a job whose insert never committed.
    (jobs / "running" / f".{RESULT_FILE}.abc.tmp").write_bytes(b"\x93NUMPY partial")
    np.save(jobs / "running" / RESULT_FILE, _frames(2))
    (jobs / "running" / "stage-dit.safetensors").write_bytes(b"not committed")
    (jobs / "ghost").mkdir()
    (jobs / "ghost" / RESULT_FILE).write_bytes(b"x")
    with JobStore.open(tmp_path) as store:
        assert _files(store) == [f"done/{RESULT_FILE}", "running/stage-text-encoder.safetensors"]
        assert store.load_result("running") is None
        assert list(store.load_intermediates("running")) == ["text-encoder"]
        assert [r.job_id for r in store.recoverable()] == ["running"]
        assert np.array_equal(store.load_result("done").frames, _frames(2))


def test_calls_from_several_threads(tmp_path: Path) -> None:
    """One connection behind a lock: record calls on one thread, file calls on worker threads."""
    errors: list[BaseException] = []
    with JobStore.open(tmp_path) as store:

        def work(worker: int) -> None:
            try:
                for i in range(15):
                    job_id = f"w{worker}-{i}"
                    _add(store, job_id, tenant=f"t{worker}", request_id=f"r{i}")
                    store.update_state(job_id, RUNNING)
                    store.mark_stage_done(job_id, "text-encoder", {"embeds": torch.full((4,), float(i))})
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
        assert not any("stage-" in name for name in _files(store))


# ----------------------------------------------------------- a real crash --

_WRITER = """
import sys

import stagediff  # noqa: F401  (imports the generated modules in a working order)
import numpy as np
import torch

from services.orchestrator.store import JobRecord, JobState, JobStore
from stagediff.v1 import generation_pb2

store = JobStore.open(sys.argv[1])
for i in range(1000):
    job_id = f"job{i:04d}"
    request = generation_pb2.GenerateRequest(prompt=f"prompt {i}", seed=i, request_id=f"req{i}")
    store.insert(JobRecord.new(job_id, f"tenant{i % 3}", request))
    print("inserted", i, flush=True)
    store.update_state(job_id, JobState.JOB_STATE_RUNNING)
    store.mark_stage_done(job_id, "text-encoder", {"embeds": torch.full((2, 64), float(i))})
    print("stage", i, flush=True)
    frames = np.full((24, 256, 256, 3), i % 251, np.uint8)
    print("saving", i, flush=True)
    store.save_result(job_id, frames, 16.0, pieces=[(0, 1), (1, 23)], timings={"total": float(i)})
    print("saved", i, flush=True)
"""


def test_sigkill_loses_no_committed_record_and_no_half_result(tmp_path: Path) -> None:
    """The writer is killed while it writes a result file (or just after, if the write is quicker)."""
    state_dir = tmp_path / "state"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(state_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    seen: dict[str, set[int]] = {"inserted": set(), "stage": set(), "saving": set(), "saved": set()}
    assert writer.stdout is not None
    for line in writer.stdout:
        what, i = line.split()
        seen[what].add(int(i))
        if what == "saving" and int(i) == 4:
            # Kill as soon as the result file is being written (or, if that was missed, written).
            job_dir = state_dir / "jobs" / "job0004"
            while writer.poll() is None and not any(
                name.startswith((".", RESULT_FILE)) for name in os.listdir(job_dir)
            ):
                pass
            writer.send_signal(signal.SIGKILL)
            break
    seen_rest = writer.stdout.read()  # lines written before the signal landed
    writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    for line in seen_rest.splitlines():
        what, i = line.split()
        seen[what].add(int(i))

    with JobStore.open(state_dir) as store:
        records = {record.job_id: record for record in store.list_jobs(limit=10_000)}
        # Every insert the writer saw committed is there, intact.
        for i in seen["inserted"]:
            record = records[f"job{i:04d}"]
            assert record.tenant == f"tenant{i % 3}" and record.request_id == f"req{i}"
            request = record.parse_request()
            assert (request.prompt, request.seed) == (f"prompt {i}", i)
        for i in seen["stage"]:
            record = records[f"job{i:04d}"]
            if record.state != SUCCEEDED:
                embeds = store.load_intermediates(record.job_id)["text-encoder"]["embeds"]
                assert torch.equal(embeds, torch.full((2, 64), float(i)))
        assert {int(job_id[3:]) for job_id, r in records.items() if r.state == SUCCEEDED} >= seen["saved"]
        # A job has a result exactly when it succeeded, and every result is whole.
        for job_id, record in records.items():
            result = store.load_result(job_id)
            if record.state != SUCCEEDED:
                assert result is None and record.state in (QUEUED, RUNNING)
                continue
            i = int(job_id[3:])
            assert result.frames.shape == (24, 256, 256, 3) and np.all(result.frames == i % 251)
            assert result.pieces == [(0, 1), (1, 23)] and result.timings == {"total": float(i)}
        assert [r.job_id for r in store.recoverable()] == sorted(
            job_id for job_id, r in records.items() if r.state != SUCCEEDED
        )
        assert not [name for name in _files(store) if name.endswith(".tmp")]
