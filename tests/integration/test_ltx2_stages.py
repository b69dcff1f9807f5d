"""LTX-2 through the real DiT and VAE stage servicers (served in-process on 127.0.0.1), against LTX2Pipeline, on
tiny checkpoints in both published layouts ("tiny": LTX-2.3's, 48 kHz; "tiny-2.0": LTX-2.0's, 24 kHz).

The wire contract of a model with sound: the DiT's Denoise stream sends the video latents frame by frame and then
one tensor "audio_latents" FP32 [1, Ca, A, M] (index 0); the VAE's Decode stream, given those tensors as the DiT
sent them, sends the frames (no empty tensor: LTX-2's decoder has none before the last latent frame) and then one
tensor "audio" FP32 [channels, samples] (index 0). The stages' audio latents equal the latents LTX2Pipeline's audio
VAE decodes, and the frames and waveform equal the pipeline's output, from the same prompts and seed. Both stages
report the vocoder's sample rate and channels in ModelLimits, and refuse audio latents that come early, twice, in
the wrong shape or not at all. A silent family (Wan) sends no audio tensor, refuses one, and reports 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from dit_svc.config import DitConfig
from dit_svc.denoise import OneRank
from dit_svc.group import DenoiserGroup
from dit_svc.service import DenoiserServicer
from services.checkpoint import read_checkpoint
from services.stage import StageRuntime
from services.torch_wire import encode_tensor, to_torch
from stagediff.tensor_codec import TensorAssembler, WireTensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc, tensor_pb2
from stagekit.denoise import DenoiseSpec
from tests.helpers.ltx2 import (
    CPU,
    PipelineRun,
    compare_frames,
    conditioning,
    reference_pipeline,
    run_pipeline,
    tiny_checkpoint,
)
from tests.helpers.serving import parse_serve
from vae_svc.config import VaeConfig
from vae_svc.service import VaeDecoderServicer

# 64x96 pixels: 2x3 latents; 17 frames: 3 latent frames, 18 audio latent frames at 24 fps; 2 steps with CFG.
SPEC = DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=3.0, seed=7)
# The denoiser's latents and the waveform are within float rounding of the pipeline's (tests/integration/
# test_family_ltx2.py, test_ltx2_decode.py).
TOLERANCE = 1e-5
SAMPLE_RATES = {"tiny": 48_000, "tiny-2.0": 24_000}


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["tiny", "tiny-2.0"])
def preset(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(preset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(preset, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model: Path) -> PipelineRun:
    return run_pipeline(reference_pipeline(model), SPEC)


class Stages:
    """The DiT and the VAE stage servicers of one checkpoint, as `stagediff serve` builds them, loaded."""

    def __init__(self, model: Path) -> None:
        checkpoint = read_checkpoint(model)
        self.dit_runtime = StageRuntime("dit", checkpoint, CPU, torch.float32)
        self.dit = DenoiserServicer(DitConfig.from_args(parse_serve(["dit", "--model", str(model)])), self.dit_runtime)
        self.vae_runtime = StageRuntime("vae", checkpoint, CPU, torch.float32)
        self.vae = VaeDecoderServicer(
            VaeConfig.from_args(parse_serve(["vae", "--model", str(model)])), self.vae_runtime
        )
        self.dit.load()
        self.vae.load()

    def serve(self, scenario: Callable[[stages_pb2_grpc.DenoiserStub, stages_pb2_grpc.VaeDecoderStub], Any]) -> None:
        """Runs `scenario(dit, vae)` with stubs of both stages served on 127.0.0.1."""

        async def run() -> None:
            servers = []
            try:
                stubs = []
                for servicer, stub in (
                    (self.dit, stages_pb2_grpc.DenoiserStub),
                    (self.vae, stages_pb2_grpc.VaeDecoderStub),
                ):
                    server = grpc.aio.server()
                    servicer.add_to_server(server)
                    port = server.add_insecure_port("127.0.0.1:0")
                    await server.start()
                    servers.append(server)
                    stubs.append(stub(grpc.aio.insecure_channel(f"127.0.0.1:{port}")))
                await scenario(*stubs)
            finally:
                for server in servers:
                    await server.stop(None)

        asyncio.run(run())


@pytest.fixture(scope="module")
def stages(model: Path) -> Stages:
    return Stages(model)


def _assembled(chunks: list[tensor_pb2.TensorChunk]) -> list[WireTensor]:
    """The tensors the chunks make, in the order they arrived."""
    assembler, tensors = TensorAssembler(), []
    for chunk in chunks:
        tensor = assembler.feed(chunk)
        if tensor is not None:
            tensors.append(tensor)
    assembler.finish()
    return tensors


def _video_and_audio_latents(chunks: list[tensor_pb2.TensorChunk]) -> tuple[torch.Tensor, WireTensor]:
    """The video latents [1, C, 3, h, w] and the audio latents of SPEC's Denoise stream, checking that they came as
    the video's three latent frames one by one, then the audio latents once, at index 0."""
    sent = _assembled(chunks)
    assert [(tensor.name, tensor.index) for tensor in sent] == [
        ("latents", 0),
        ("latents", 1),
        ("latents", 2),
        ("audio_latents", 0),
    ]
    return torch.cat([to_torch(tensor) for tensor in sent[:3]], dim=2), sent[3]


def _denoise_params(spec: DenoiseSpec) -> stages_pb2.DenoiseRequest:
    return stages_pb2.DenoiseRequest(
        params=stages_pb2.DenoiseParams(
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale,
            seed=spec.seed,
            fps=spec.fps,
        )
    )


async def _denoise(
    dit: stages_pb2_grpc.DenoiserStub, spec: DenoiseSpec, tensors: dict[str, torch.Tensor]
) -> tuple[list[stages_pb2.DenoiseResponse], list[tensor_pb2.TensorChunk]]:
    """Every response of a Denoise call, and its tensor chunks as they came."""
    requests = [_denoise_params(spec)]
    requests += [
        stages_pb2.DenoiseRequest(tensor=chunk)
        for name, tensor in tensors.items()
        for chunk in encode_tensor(name, tensor)
    ]
    responses = [response async for response in dit.Denoise(iter(requests))]
    return responses, [response.tensor for response in responses if response.HasField("tensor")]


async def _decode(
    vae: stages_pb2_grpc.VaeDecoderStub, num_latent_frames: int, chunks: list[tensor_pb2.TensorChunk]
) -> list[WireTensor]:
    requests = [stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=num_latent_frames))]
    requests += [stages_pb2.DecodeRequest(tensor=chunk) for chunk in chunks]
    return _assembled([response.tensor async for response in vae.Decode(iter(requests))])


async def _responses(call: Any) -> list[Any]:
    return [response async for response in call]


async def _refused(call: Any) -> str:
    """The details of a call refused with INVALID_ARGUMENT."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    return str(raised.value.details())


def test_stages_send_the_pipelines_audio_latents_frames_and_audio(
    preset: str, model: Path, stages: Stages, reference: PipelineRun
) -> None:
    texts = conditioning(model)
    expected = reference.output

    async def scenario(dit: stages_pb2_grpc.DenoiserStub, vae: stages_pb2_grpc.VaeDecoderStub) -> None:
        started = time.perf_counter()
        responses, chunks = await _denoise(dit, SPEC, texts)
        denoised = time.perf_counter()
        progress = [response.progress.step for response in responses if response.HasField("progress")]
        assert progress == list(range(1, SPEC.num_inference_steps + 1))
        video, audio_latents = _video_and_audio_latents(chunks)
        assert audio_latents.datatype == "FP32"
        assert list(audio_latents.shape) == list(reference.audio_latents.shape)
        assert (video - reference.video_latents).abs().max() <= TOLERANCE
        assert (to_torch(audio_latents) - reference.audio_latents).abs().max() <= TOLERANCE

        # The VAE stage gets the DiT's chunks as they came, as the orchestrator forwards them.
        decoded = await _decode(vae, 3, chunks)
        finished = time.perf_counter()
        assert [(tensor.name, tensor.index) for tensor in decoded] == [("frames", 0), ("audio", 0)]
        frames, audio = decoded
        compare_frames(f"{preset} stages", to_torch(frames), expected.frames[0])
        theirs = expected.audio[0].numpy()
        assert audio.datatype == "FP32" and audio.array.shape == theirs.shape and theirs.shape[0] == 2
        difference = float(np.abs(audio.array - theirs).max())
        assert difference <= TOLERANCE and float(np.abs(theirs).max()) > 0.01
        print(
            f"{preset}: DiT {denoised - started:.2f} s, VAE {finished - denoised:.2f} s; waveform {theirs.shape}, "
            f"max abs diff {difference:.2e}"
        )

    stages.serve(scenario)
    for runtime in (stages.dit_runtime, stages.vae_runtime):
        info = runtime.info()  # what GetStageInfo answers
        assert info.family == "ltx-2"
        assert (info.limits.audio_sample_rate, info.limits.audio_channels) == (SAMPLE_RATES[preset], 2)


def test_the_requests_fps_is_the_pipelines_frame_rate(model: Path, stages: Stages) -> None:
    """At 12 fps the sound lasts twice as long as at 24 and the video's positions in time are spaced twice as far:
    the DiT's latents equal LTX2Pipeline's at frame_rate 12. A frame rate that would make the sound longer than
    the model's longest video is refused, naming fps."""
    slow = dataclasses.replace(SPEC, fps=12.0)
    expected = run_pipeline(reference_pipeline(model), slow)
    texts = conditioning(model)

    async def scenario(dit: stages_pb2_grpc.DenoiserStub, vae: stages_pb2_grpc.VaeDecoderStub) -> None:
        _, chunks = await _denoise(dit, slow, texts)
        sent = _assembled(chunks)
        video = torch.cat([to_torch(tensor) for tensor in sent[:3]], dim=2)
        audio_latents = to_torch(sent[3])
        assert audio_latents.shape == expected.audio_latents.shape
        assert (video - expected.video_latents).abs().max() <= TOLERANCE
        assert (audio_latents - expected.audio_latents).abs().max() <= TOLERANCE
        # Refused at the params, the first message: the call sends nothing more.
        call = dit.Denoise(iter([_denoise_params(dataclasses.replace(slow, fps=0.01))]))
        refused = await _refused(_responses(call))
        assert refused.startswith("fps: 17 frames at 0.01 fps last 1.7e+03 s"), refused

    stages.serve(scenario)


def test_stages_refuse_audio_input_out_of_place(preset: str, model: Path, stages: Stages) -> None:
    """The DiT refuses a request without the audio stream's text embeddings. The VAE refuses audio latents before
    the last latent frame, twice, of the wrong shape, or missing, each naming what to send; one latent frame and the
    audio latents decode."""
    decoder = stages.vae.decoder
    channels, mel_bins = decoder.audio_latent_channels, decoder.audio_latent_mel_bins  # type: ignore[union-attr]
    latent = list(encode_tensor("latents", torch.zeros(1, decoder.latent_channels, 1, 2, 3)))  # type: ignore[union-attr]
    texts = {name: tensor for name, tensor in conditioning(model).items() if name != "prompt_audio_embeds"}
    audio = list(encode_tensor("audio_latents", torch.zeros(1, channels, 3, mel_bins)))
    wrong = list(encode_tensor("audio_latents", torch.zeros(1, channels + 1, 3, mel_bins)))

    async def scenario(dit: stages_pb2_grpc.DenoiserStub, vae: stages_pb2_grpc.VaeDecoderStub) -> None:
        assert "prompt_audio_embeds: missing" in await _refused(_denoise(dit, SPEC, texts))
        assert "send it after the last" in await _refused(_decode(vae, 2, [*latent, *audio]))
        assert "sent twice" in await _refused(_decode(vae, 1, [*latent, *audio, *audio]))
        assert f"expected [1, {channels}, A, {mel_bins}]" in await _refused(_decode(vae, 1, [*latent, *wrong]))
        assert "'audio_latents': missing" in await _refused(_decode(vae, 1, latent))
        decoded = await _decode(vae, 1, [*latent, *audio])
        assert [(tensor.name, tensor.index) for tensor in decoded] == [("frames", 0), ("audio", 0)]
        assert list(decoded[0].shape) == [1, SPEC.height, SPEC.width, 3]

    stages.serve(scenario)


def test_cancelled_denoise_stops_between_steps(model: Path, stages: Stages) -> None:
    """A call cancelled after its first progress event stops the joint loop before the next step: one step of the
    twelve asked for runs. The first step's end waits until the stage has seen the cancellation, so nothing races
    the clock."""
    runner = stages.dit.runner
    assert isinstance(runner, OneRank)
    steps: list[int] = []

    class Watching(OneRank):
        def denoise_av_request(self, spec, conditioning, on_step, cancelled):  # type: ignore[no-untyped-def]
            def stepped(step: int, total: int) -> None:
                steps.append(step)
                on_step(step, total)  # the progress event goes out; the client cancels on it
                deadline = time.monotonic() + 30
                while not cancelled() and time.monotonic() < deadline:
                    time.sleep(0.005)

            return super().denoise_av_request(spec, conditioning, stepped, cancelled)

    spec = DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=12, guidance_scale=3.0, seed=7)
    texts = conditioning(model)
    requests = [_denoise_params(spec)]
    requests += [stages_pb2.DenoiseRequest(tensor=chunk) for n, t in texts.items() for chunk in encode_tensor(n, t)]
    progress = []

    async def scenario(dit: stages_pb2_grpc.DenoiserStub, vae: stages_pb2_grpc.VaeDecoderStub) -> None:
        call = dit.Denoise(iter(requests))
        async for response in call:
            assert response.HasField("progress")
            progress.append(response.progress.step)
            call.cancel()
            break
        await stages.dit_runtime.run(lambda: None)  # the compute thread is done with the request

    stages.dit.runner = Watching(runner.denoiser, runner.mag_ratios, runner.adapters)
    try:
        stages.serve(scenario)
    finally:
        stages.dit.runner = runner
    assert progress == [1] and steps == [1]


# One layout is enough for the group's sound path: the presets differ only in their weights.
@pytest.mark.parametrize("preset", ["tiny"], indirect=True)
def test_hsdp_group_sends_the_pipelines_video_and_audio_latents(model: Path, reference: PipelineRun) -> None:
    """The DiT stage on two ranks with `--use-hsdp` (each rank holding half the transformer, dit_svc/group.py): the
    video latents frame by frame and then the audio latents, both equal to LTX2Pipeline's. A request cancelled
    after its first step stops every rank there: the group still answers the next request, and the same."""
    flags = ["dit", "--model", str(model), "--use-hsdp", "--hsdp-shard-size", "2"]
    runtime = StageRuntime("dit", read_checkpoint(model), CPU, torch.float32)
    dit = DenoiserServicer(DitConfig.from_args(parse_serve(flags)), runtime)
    dit.load()
    texts = conditioning(model)
    long = dataclasses.replace(SPEC, num_inference_steps=12)
    requests = [_denoise_params(long)]
    requests += [stages_pb2.DenoiseRequest(tensor=chunk) for n, t in texts.items() for chunk in encode_tensor(n, t)]

    async def scenario() -> None:
        server = grpc.aio.server()
        dit.add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            stub = stages_pb2_grpc.DenoiserStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            cancelled = stub.Denoise(iter(requests))
            async for response in cancelled:
                assert response.HasField("progress") and response.progress.step == 1
                cancelled.cancel()
                break
            for _ in range(2):  # after the cancelled call, and once more
                _, chunks = await _denoise(stub, SPEC, texts)
                video, audio_latents = _video_and_audio_latents(chunks)
                assert (video - reference.video_latents).abs().max() <= TOLERANCE
                assert (to_torch(audio_latents) - reference.audio_latents).abs().max() <= TOLERANCE
        finally:
            await server.stop(None)

    try:
        assert isinstance(dit.denoiser, DenoiserGroup)
        asyncio.run(scenario())
        assert dit.denoiser.failure() is None
    finally:
        dit.close()


def test_silent_family_sends_no_audio_and_reports_none(tiny_model: Path) -> None:
    """Wan (no sound): the DiT sends latents alone, the VAE frames alone and refuses audio latents, and both report
    audio_sample_rate and audio_channels 0."""
    stages = Stages(tiny_model)
    spec = DenoiseSpec(height=16, width=16, num_frames=5, num_inference_steps=2, guidance_scale=1.0, seed=3)
    text_dim = stages.dit.denoiser.text_dim  # type: ignore[union-attr]
    texts = {"prompt_embeds": torch.randn(1, 4, text_dim, generator=torch.Generator().manual_seed(0))}

    async def scenario(dit: stages_pb2_grpc.DenoiserStub, vae: stages_pb2_grpc.VaeDecoderStub) -> None:
        _, chunks = await _denoise(dit, spec, texts)
        sent = _assembled(chunks)
        assert {tensor.name for tensor in sent} == {"latents"}
        decoded = await _decode(vae, len(sent), chunks)
        assert {tensor.name for tensor in decoded} == {"frames"}
        assert sum(tensor.shape[0] for tensor in decoded) == spec.num_frames
        audio = list(encode_tensor("audio_latents", torch.zeros(1, 8, 3, 16)))
        assert "makes no sound" in await _refused(_decode(vae, len(sent), [*chunks, *audio]))

    stages.serve(scenario)
    for runtime in (stages.dit_runtime, stages.vae_runtime):
        limits = runtime.info().limits
        assert (limits.audio_sample_rate, limits.audio_channels) == (0, 0)
