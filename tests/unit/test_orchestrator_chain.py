"""The orchestrator runs the served family's chain with the stages it has endpoints for, and relays bytes.

Fake stages (text encoder, DiT, VAE) serve on 127.0.0.1 from the test's event loop and record what they
receive; the orchestrator's own GenerationServicer, Pipeline, JobManager and StagePool run against them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from families.registry import family_named
from services.orchestrator.chain import stages_for
from services.orchestrator.job import JobState
from services.orchestrator.store import JobRecord, JobStore
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2
from tests.helpers.fake_stages import (
    MODEL,
    ChainOrchestrator,
    FakeDenoiser,
    FakeStages,
    generate,
    generate_request,
    refusal,
)


def _frames(events) -> list:
    assembler = TensorAssembler()
    return [tensor for e in events if e.HasField("result") if (tensor := assembler.feed(e.result.tensor))]


def test_stages_for_follows_the_chain_and_the_request() -> None:
    wan, qwen = family_named("wan-t2v"), family_named("qwen-image")
    interpolated = generate_request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=1))
    assert stages_for(wan, generate_request()) == ("text-encoder", "dit", "vae")
    assert stages_for(wan, interpolated) == ("text-encoder", "dit", "vae", "interp")
    # enable without exp asks for nothing.
    off = generate_request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=0))
    assert stages_for(wan, off) == ("text-encoder", "dit", "vae")
    assert stages_for(qwen, interpolated) == ("text-encoder", "dit", "vae")


def test_without_an_interpolator_requests_run_without_interpolation_and_refuse_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state")
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            events = await generate(orchestrator.endpoint, generate_request())
            frames = _frames(events)
            assert [(f.index, f.shape[0]) for f in frames] == [(0, 1), (1, 4), (5, 4)]
            assert [int(f.array[0, 0, 0, 0]) for f in frames] == [0, 1, 2]
            assert events[-1].completed.num_frames == 9 and events[-1].completed.fps == 16.0
            stages_run = {e.progress.stage for e in events if e.HasField("progress")}
            assert stages_run == {"text-encoder", "dit", "vae"}
            # The DiT got the text encoder's chunks as they were sent: names, headers, offsets and bytes.
            assert stages.denoiser.received == [stages.text_encoder.sent]
            names = [c.header.name for c in stages.text_encoder.sent if c.HasField("header")]
            assert names == ["prompt_embeds", "negative_prompt_embeds"]

            interpolated = generate_request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=1))
            error = await refusal(orchestrator.endpoint, interpolated)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            for words in ("interpolation:", "this deployment has no frame interpolator", "--interp"):
                assert words in error.details()
            assert len(stages.denoiser.received) == 1, "the refused request reached no stage"

            # Cluster info lists the stages this orchestrator has, and no interpolator.
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetClusterInfo(
                    generation_pb2.GetClusterInfoRequest()
                )
            assert [(s.info.stage, s.health) for s in info.stages] == [
                ("text-encoder", "SERVING"),
                ("dit", "SERVING"),
                ("vae", "SERVING"),
            ]
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_a_stage_the_chain_needs_without_an_endpoint_refuses_requests_naming_its_flag(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = ChainOrchestrator(
            {"text-encoder": stages.endpoints["text-encoder"], "dit": stages.endpoints["dit"]}, tmp_path / "state"
        )
        await orchestrator.start()
        try:
            await orchestrator.pool["dit"].wait_serving()
            error = await refusal(orchestrator.endpoint, generate_request())
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            for words in (
                "wan-t2v",
                "text-encoder -> dit -> vae -> [interp]",
                "no endpoint for vae",
                "--vae HOST:PORT",
            ):
                assert words in error.details()
            assert stages.denoiser.received == []
            assert not orchestrator.servicer.ready.is_set()
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetClusterInfo(
                    generation_pb2.GetClusterInfoRequest()
                )
            listed = {s.info.stage: s for s in info.stages}
            assert list(listed) == ["text-encoder", "dit", "vae"]
            assert listed["vae"].health == "NOT_SERVING" and "--vae HOST:PORT" in listed["vae"].detail
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_a_restarted_orchestrator_relays_the_stored_chunks_without_running_their_stages(tmp_path: Path) -> None:
    """A job whose DiT had finished when the orchestrator stopped: its stored conditioning and latents are the
    chunks the stages sent, and the VAE decodes the latents after the restart without the text encoder or the
    DiT running again."""
    request = generate_request(model=MODEL, num_inference_steps=2, guidance_scale=5.0, fps=16.0)
    conditioning = [
        *encode_tensor("prompt_embeds", np.ones((1, 4, 8), np.float32), chunk_bytes=48),
        *encode_tensor("negative_prompt_embeds", np.zeros((1, 4, 8), np.float32), chunk_bytes=48),
    ]
    latents = [
        chunk for t in range(3) for chunk in encode_tensor("latents", np.full((1, 4, 1, 4, 4), t, np.float32), index=t)
    ]
    with JobStore.open(tmp_path / "state") as store:
        store.insert(JobRecord.new("stopped-job", "default", request))
        store.update_state("stopped-job", JobState.JOB_STATE_RUNNING)
        assert store.mark_stage_done("stopped-job", "text-encoder", conditioning)
        assert store.mark_stage_done("stopped-job", "dit", latents)

    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state")
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            job = await orchestrator.jobs.get("stopped-job", "default")
            events = [event async for event in job.follow()]
            assert job.state == JobState.JOB_STATE_SUCCEEDED, job.error_message
            frames = _frames(events)
            assert [(f.index, f.shape[0], int(f.array[0, 0, 0, 0])) for f in frames] == [
                (0, 1, 0),
                (1, 4, 1),
                (5, 4, 2),
            ]
            assert stages.text_encoder.sent == [] and stages.denoiser.received == []
            assert stages.vae.calls == 1
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


class HeldDenoiser(FakeDenoiser):
    """The fake DiT, reporting its passes after its step and holding its latents while `held` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.holding = asyncio.Event()

    async def Denoise(self, request_iterator, context):
        async for response in super().Denoise(request_iterator, context):
            yield response
            if response.HasField("progress"):
                yield stages_pb2.DenoiseResponse(passes=stages_pb2.TransformerPasses(run=3, skipped=1))
                while self.held:
                    self.holding.set()
                    await asyncio.sleep(3600)


def test_stage_outputs_are_stored_behind_the_job_and_when_it_stops_to_resume(tmp_path: Path) -> None:
    """A job that commits before its outputs were due writes none (its commit records the DiT's passes); a job
    stopped by a shutdown writes its finished stages' outputs at once, and the next start resumes after them."""

    async def scenario() -> None:
        stages = FakeStages()
        stages.denoiser = denoiser = HeldDenoiser()
        await stages.start()
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state", keep_outputs_after_s=3600)
        written: list[tuple[str, str]] = []
        mark_stage_done = orchestrator.store.mark_stage_done

        def recorded(job_id: str, stage: str, *args, **kwargs) -> bool:
            written.append((job_id, stage))
            return mark_stage_done(job_id, stage, *args, **kwargs)

        orchestrator.store.mark_stage_done = recorded  # type: ignore[method-assign]
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            events = await generate(orchestrator.endpoint, generate_request(request_id="quick"))
            quick = events[0].job_id
            assert events[-1].HasField("completed") and written == []
            record = orchestrator.store.get(quick)
            assert record is not None and (record.passes_run, record.passes_skipped) == (3, 1)

            denoiser.held = True
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                held = await generation_pb2_grpc.GenerationStub(channel).Submit(generate_request(request_id="held"))
            await denoiser.holding.wait()
        finally:
            await orchestrator.stop()  # the held job stops, to run again at the next start
        assert written == [(held.job_id, "text-encoder")]
        denoiser.held = False
        encoded = len(stages.text_encoder.sent)
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state")
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            job = await orchestrator.jobs.get(held.job_id, "default")
            [event async for event in job.follow()]
            assert job.state == JobState.JOB_STATE_SUCCEEDED, job.error_message
            assert len(stages.text_encoder.sent) == encoded, "the text encoder ran again"
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())
