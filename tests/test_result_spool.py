"""Result frames stream to the store as they are published; memory holds no frames, per job or per reader.

The orchestrator's real JobManager and Pipeline run here with the stage calls replaced (`FramePipeline`):
each job "decodes" frames computed from its request and publishes them as the VAE does (one frame, then
four per latent frame), through the real ResultPublisher into the real result file.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.orchestrator.jobs import JobManager, JobState, ResultPiece
from services.orchestrator.pipeline import Pipeline, ResultPublisher
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import RESULT_FILE, JobStore, StoreError
from services.orchestrator.tenants import Tenant
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2

REPO = Path(__file__).resolve().parents[1]
SUCCEEDED = JobState.JOB_STATE_SUCCEEDED
ACME = Tenant(name="acme")


def make_request(
    num_frames: int, height: int = 16, width: int = 32, *, seed: int = 0, request_id: str = ""
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="fake",
        prompt="a fox",
        height=height,
        width=width,
        num_frames=num_frames,
        seed=seed,
        fps=16.0,
        request_id=request_id,
    )


def expected_frames(request: generation_pb2.GenerateRequest, first: int = 0, count: int | None = None) -> np.ndarray:
    """The frames FramePipeline makes for `request`: each frame filled from its index and the seed."""
    count = request.num_frames - first if count is None else count
    frames = np.empty((count, request.height, request.width, 3), np.uint8)
    for i in range(count):
        frames[i] = (request.seed * 7 + first + i) % 256
        frames[i, 0, 0] = [(first + i) % 256, (first + i) // 256, request.seed % 256]
    return frames


def vae_pieces(num_frames: int) -> list[tuple[int, int]]:
    """(first, count) of the tensors a Wan VAE sends: one frame, then four per latent frame."""
    pieces, first = [], 0
    while first < num_frames:
        count = 1 if first == 0 else min(4, num_frames - first)
        pieces.append((first, count))
        first += count
    return pieces


class FramePipeline(Pipeline):
    """The orchestrator's Pipeline with its stage calls replaced by frames made here.

    `before_piece(job, first)` runs before each piece is published (a test may block or fail there).
    """

    def __init__(self, store: JobStore, before_piece=None) -> None:
        super().__init__(stages=None, store=store, retry_backoff_s=0.0)
        self.before_piece = before_piece

    async def _run_once(self, job) -> None:
        request = job.request
        job.fps_out = request.fps
        publisher = ResultPublisher(job, job.result, job.fps_out, self.metrics)
        for first, count in vae_pieces(request.num_frames):
            if self.before_piece is not None:
                await self.before_piece(job, first)
            for chunk in encode_tensor("frames", expected_frames(request, first, count), index=first):
                await publisher.publish(chunk)


def assemble(events) -> tuple[np.ndarray, list[tuple[int, int]]]:
    assembler = TensorAssembler()
    arrays, pieces = [], []
    for event in events:
        if event.HasField("result"):
            tensor = assembler.feed(event.result.tensor)
            if tensor is not None:
                arrays.append(tensor.array)
                pieces.append((tensor.index, tensor.array.shape[0]))
    assembler.finish()
    return np.concatenate(arrays), pieces


def test_frames_go_to_the_store_as_they_stream_and_the_log_holds_none(tmp_path: Path) -> None:
    request = make_request(500, seed=3, request_id="r1")

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs = JobManager(FramePipeline(store).run, FairScheduler(), store)
            job, created = await jobs.submit(request, ACME)
            live = [event async for event in job.follow()]
            assert created and job.state == SUCCEEDED, job.error_message
            # The job's log holds small markers, never frames.
            assert not any(isinstance(e, generation_pb2.GenerateEvent) and e.HasField("result") for e in job.events)
            markers = [(e.first, e.count) for e in job.events if isinstance(e, ResultPiece)]
            assert markers == vae_pieces(500)
            # Watchers get the stream they always got: each piece's encode_tensor chunks, then completed.
            expected_chunks = [
                chunk
                for first, count in vae_pieces(500)
                for chunk in encode_tensor("frames", expected_frames(request, first, count), index=first)
            ]
            assert [e.result.tensor for e in live if e.HasField("result")] == expected_chunks
            assert live[-1].completed.num_frames == 500 and all(e.job_id == job.job_id for e in live)
            # The file was written in place: the result and nothing else is left in the job's folder.
            assert sorted(os.listdir(store.jobs_dir / job.job_id)) == [RESULT_FILE]
            frames, _ = assemble(live)
            assert np.array_equal(frames, expected_frames(request))

            # Once the job has left memory, WatchJob and a request-id retry stream the same from disk.
            jobs.jobs.clear()
            jobs.by_request_id.clear()
            stored = await jobs.get(job.job_id, "acme")
            assert stored.stored_in is store and stored.events == []
            replay = [event async for event in stored.follow()]
            assert [e.result.tensor for e in replay if e.HasField("result")] == expected_chunks
            assert replay[-1] == live[-1]
            again, created = await jobs.submit(request, ACME)
            assert not created and again.job_id == job.job_id
            assert [e.result.tensor async for e in again.follow() if e.HasField("result")] == expected_chunks

    asyncio.run(scenario())


def test_get_job_answers_from_the_record_without_reading_the_result(tmp_path: Path) -> None:
    request = make_request(9)

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs = JobManager(FramePipeline(store).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            await job.task
            jobs.jobs.clear()
            # The result file is gone (or unreadable): GetJob does not notice, a watcher does.
            (store.jobs_dir / job.job_id / RESULT_FILE).unlink()
            found = await jobs.get(job.job_id, "acme")
            proto = found.to_proto(jobs.position(found))
            assert (proto.state, proto.num_frames_out, proto.fps_out) == (SUCCEEDED, 9, 16.0)
            assert await jobs.get(job.job_id, "someone-else") is None
            with pytest.raises(StoreError, match="cannot be read"):
                [event async for event in found.follow()]

    asyncio.run(scenario())


def test_a_failed_job_deletes_its_partial_result_and_watchers_get_no_frames_after(tmp_path: Path) -> None:
    request = make_request(9)

    async def fail_at_frame_5(job, first: int) -> None:
        if first == 5:
            raise StoreError("the disk went away")

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs = JobManager(FramePipeline(store, fail_at_frame_5).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            await job.task
            assert job.state == JobState.JOB_STATE_FAILED and "the disk went away" in job.error_message
            assert [(e.first, e.count) for e in job.events if isinstance(e, ResultPiece)] == [(0, 1), (1, 4)]
            assert os.listdir(store.jobs_dir / job.job_id) == []
            # A watcher that comes late sees the progress it missed and the error, not the deleted frames.
            late = [event async for event in job.follow()]
            assert not any(event.HasField("result") for event in late)
            assert store.get(job.job_id).state == JobState.JOB_STATE_FAILED

    asyncio.run(scenario())


# 16 watchers replay one stored 500-frame result at once. The pure-Python protobuf runtime keeps message bytes
# as Python objects, so tracemalloc sees every frame a reader holds (the upb runtime's arenas it would not).
_REPLAY = """
import asyncio
import json
import sys
import tracemalloc

import stagediff  # noqa: F401  (imports the generated modules in a working order)
import numpy as np

from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import JobRecord, JobState, JobStore
from stagediff.v1 import generation_pb2

READERS, FRAMES, HEIGHT, WIDTH = 16, 500, 192, 256
store = JobStore.open(sys.argv[1])
request = generation_pb2.GenerateRequest(height=HEIGHT, width=WIDTH, num_frames=FRAMES)
store.insert(JobRecord.new("replayed", "acme", request))
store.update_state("replayed", JobState.JOB_STATE_RUNNING)
frames = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
frames[:, 0, 0, 0] = np.arange(FRAMES) % 256
pieces = [(0, 1)] + [(first, min(4, FRAMES - first)) for first in range(1, FRAMES, 4)]
store.save_result("replayed", frames, 16.0, pieces=pieces)
video_bytes = frames.nbytes
del frames


async def run_job(job):
    raise AssertionError("nothing runs here")


async def replay(jobs):
    job = await jobs.get("replayed", "acme")
    received = 0
    async for event in job.follow():
        if event.HasField("result"):
            received += len(event.result.tensor.data)
    return received


async def main():
    jobs = JobManager(run_job, FairScheduler(), store)
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    received = await asyncio.gather(*(replay(jobs) for _ in range(READERS)))
    peak = tracemalloc.get_traced_memory()[1] - baseline
    print(json.dumps({"peak": peak, "received": received, "video_bytes": video_bytes}))


asyncio.run(main())
store.close()
"""


def test_sixteen_watchers_of_a_stored_result_hold_a_chunk_each_not_the_video(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(tmp_path / "state")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.splitlines()[-1])
    video = measured["video_bytes"]
    assert measured["received"] == [video] * 16
    # Each reader holds about one 1 MiB chunk (read, then in its message) at a time: the bound is tied to the
    # chunk size and the readers, and it is below one copy of the 74 MB video, let alone sixteen.
    bound = 16 * 3 * (1 << 20)
    assert bound < video
    assert measured["peak"] < bound, f"peak {measured['peak']} bytes traced, for 16 readers of {video} bytes"
