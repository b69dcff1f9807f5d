"""The public API beyond Generate: jobs, cancellation, deadlines, models, cluster info, streaming."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from services.stage_table import STAGES
from stagediff import Client, StageDiffError
from stagediff.client import FramesReceived, GenerationResult, Progress, Queued
from stagediff.v1 import generation_pb2

pytestmark = pytest.mark.e2e

SMALL = dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0)


def test_progress_events_and_result(cluster) -> None:
    with Client(cluster.endpoint) as client:
        events = list(client.stream("a fox", seed=5, **SMALL))
    assert isinstance(events[0], Queued)
    dit_steps = [(e.step, e.total) for e in events if isinstance(e, Progress) and e.stage == "dit"]
    assert dit_steps == [(1, 2), (2, 2)]
    vae_steps = [e.step for e in events if isinstance(e, Progress) and e.stage == "vae"]
    assert vae_steps == [1, 2, 3]  # 9 frames = 3 latent frames, one decoded chunk each
    received = [e for e in events if isinstance(e, FramesReceived)]
    assert [(e.first_frame, e.count) for e in received] == [(0, 1), (1, 4), (5, 4)]
    assert isinstance(events[-1], GenerationResult) and events[-1].frames.shape == (9, 64, 64, 3)


def test_submit_get_watch_and_list(cluster) -> None:
    with Client(cluster.endpoint) as client:
        job = client.submit("a lighthouse", request_id="idempotent-1", seed=9, **SMALL)
        again = client.submit("a lighthouse", request_id="idempotent-1", seed=9, **SMALL)
        assert again.job_id == job.job_id, "a retried Submit with the same request_id returns the same job"
        result = client.wait(job.job_id)
        assert result.frames.shape == (9, 64, 64, 3)
        fetched = client.get_job(job.job_id)
        assert fetched.state == generation_pb2.JOB_STATE_SUCCEEDED
        assert fetched.request.seed == 9 and fetched.num_frames_out == 9
        assert fetched.timings["total"] > 0
        listed = client.list_jobs(state=generation_pb2.JOB_STATE_SUCCEEDED)
        assert job.job_id in [j.job_id for j in listed]
        # A finished job's result can be fetched again, whole.
        assert np.array_equal(client.wait(job.job_id).frames, result.frames)


def test_unknown_job_is_not_found(cluster) -> None:
    with Client(cluster.endpoint) as client:
        for call in (client.get_job, client.cancel, client.wait):
            with pytest.raises(StageDiffError) as raised:
                call("no-such-job")
            assert raised.value.code == grpc.StatusCode.NOT_FOUND and "no-such-job" in raised.value.message


def test_cancel_a_running_job_frees_the_stages(cluster) -> None:
    with Client(cluster.endpoint) as client:
        job = client.submit("a long one", seed=1, height=64, width=64, num_frames=9, num_inference_steps=400)
        deadline = time.monotonic() + 60
        while client.get_job(job.job_id).current_stage != "dit" and time.monotonic() < deadline:
            time.sleep(0.05)
        cancelled = client.cancel(job.job_id)
        assert cancelled.state == generation_pb2.JOB_STATE_CANCELLED
        with pytest.raises(StageDiffError) as raised:
            client.wait(job.job_id)
        assert raised.value.code == grpc.StatusCode.CANCELLED
        # The DiT stops within a step, so the next job runs promptly (not after 400 steps).
        started = time.monotonic()
        assert client.generate("next", seed=2, **SMALL).frames.shape[0] == 9
        assert time.monotonic() - started < 60


def test_deadline_cancels_the_job(cluster) -> None:
    with Client(cluster.endpoint) as client:
        with pytest.raises(StageDiffError) as raised:
            client.generate(
                "slow",
                seed=1,
                request_id="deadline-1",
                timeout=1.5,
                # Far longer than the deadline however fast the machine (400 steps of 64x64x9 took under 2 s).
                height=128,
                width=128,
                num_frames=17,
                num_inference_steps=1000,
            )
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        (job,) = [j for j in client.list_jobs() if j.request.request_id == "deadline-1"]
        deadline = time.monotonic() + 30
        while job.state not in (generation_pb2.JOB_STATE_CANCELLED, generation_pb2.JOB_STATE_FAILED):
            assert time.monotonic() < deadline, _still_running(cluster, job)
            time.sleep(0.1)
            job = client.get_job(job.job_id)


def _still_running(cluster, job: generation_pb2.Job) -> str:
    """Why a job outlived its deadline, as far as its record and the orchestrator's log say."""
    state = generation_pb2.JobState.Name(job.state)
    logged = [
        line
        for path in sorted(cluster.log_dir.glob("orchestrator*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if job.job_id in line
    ]
    return f"the job kept running after its deadline: {state} in '{job.current_stage}'; its log:\n" + "\n".join(
        logged[-40:]
    )


def test_list_models_and_cluster_info(cluster) -> None:
    with Client(cluster.endpoint) as client:
        models = client.list_models()
        info = client.cluster_info()
    assert [m.id for m in models] == ["tiny"] and models[0].family == "wan-t2v"
    assert models[0].limits.height_multiple == 16 and models[0].limits.temporal_factor == 4
    stages = {s.info.stage: s for s in info.stages}
    assert set(stages) == {"text-encoder", "dit", "vae", "interp"}
    for name, status in stages.items():
        assert status.health == "SERVING", name
        # The interpolator does not read the diffusers checkpoint: its weights are its own.
        assert status.info.model == ("tiny" if STAGES[name].reads_checkpoint else ""), name
        assert status.info.device == "cpu"
        assert status.endpoint == cluster.services[name].endpoint
    assert stages["dit"].info.parameter_bytes["transformer"] > 0
    assert stages["vae"].info.parameter_bytes["vae"] > 0
    assert stages["text-encoder"].info.parameter_bytes["text_encoder"] > 0


@pytest.mark.parametrize("interp_exp", [0, 1], ids=["decoded", "interpolated"])
def test_first_frames_reach_the_client_before_the_vae_has_decoded_the_last_chunk(cluster, interp_exp) -> None:
    """Stop the VAE process the moment the first frames arrive: the rest must still be missing.

    If anything between the VAE and the client buffered the whole video, every
    frame would already be on its way when the first arrived, and all of them
    would reach the client while the VAE is stopped.
    """
    vae_pid = cluster.services["vae"].pid
    num_frames = 33  # 9 latent frames: 9 decode steps in the VAE
    frames_out = (num_frames - 1) * 2**interp_exp + 1
    events: list[object] = []
    first_frames = threading.Event()

    def consume() -> None:
        with Client(cluster.endpoint) as client:
            for event in client.stream(
                "streaming",
                seed=4,
                height=256,
                width=256,
                num_frames=num_frames,
                num_inference_steps=1,
                guidance_scale=1.0,
                interp_exp=interp_exp,
            ):
                if isinstance(event, FramesReceived) and not first_frames.is_set():
                    os.kill(vae_pid, signal.SIGSTOP)
                    first_frames.set()
                events.append(event)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        assert first_frames.wait(timeout=120), "no frames arrived"
        time.sleep(2.0)  # whatever was decoded before the stop drains to the client meanwhile
        frames_while_stopped = sum(e.count for e in list(events) if isinstance(e, FramesReceived))
    finally:
        os.kill(vae_pid, signal.SIGCONT)
    consumer.join(timeout=120)
    assert 0 < frames_while_stopped < frames_out
    assert isinstance(events[-1], GenerationResult) and events[-1].frames.shape[0] == frames_out


def test_unset_fields_take_the_checkpoint_defaults(cluster) -> None:
    with Client(cluster.endpoint) as client:
        job = client.submit("defaults")
        result = client.wait(job.job_id)
        filled = client.get_job(job.job_id).request
    # tiny's stagediff.json: 64x64, 9 frames, 2 steps, guidance 5, 16 fps; a random seed is recorded.
    assert (filled.height, filled.width, filled.num_frames, filled.num_inference_steps) == (64, 64, 9, 2)
    assert filled.guidance_scale == 5.0 and filled.fps == 16.0 and filled.HasField("seed")
    assert result.frames.shape == (9, 64, 64, 3) and result.fps == 16.0
