"""Result frames stream to the store as they are published; memory holds no frames, per job or per reader.

The orchestrator's real JobManager and Pipeline run here with the stage calls replaced (`FramePipeline`):
each job "decodes" frames computed from its request and publishes them as the VAE does (one frame, then
four per latent frame), through the real ResultPublisher into the real result file.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from services.orchestrator.job import JobState, ResultPiece
from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import RESULT_FILE, JobStore, StoreError
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2
from tests.helpers.result_pipeline import ACME, FramePipeline, assemble, expected_frames, make_request, vae_pieces

SUCCEEDED = JobState.JOB_STATE_SUCCEEDED


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
