"""The sound of a model that makes video with sound (LTX-2), from the VAE's "audio" tensor to the client: the relay
(past the interpolator), the checks on what the VAE sends, the store (kept, counted, replayed, deleted, in blobs
too), the encoded file (AAC in mp4), the request's audio_codec, and the SDK's GenerationResult.audio.

The orchestrator's real Pipeline (its `_run_once`, relay and StageCalls), ResultPublisher, EncodedResult and
JobManager run here against in-process fake stage replicas; no model, no server, no cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import wave
from pathlib import Path
from types import SimpleNamespace

import av
import grpc
import numpy as np
import pytest

from families.registry import family_named
from services.encoding import OUTPUT_FORMATS, check_audio
from services.orchestrator.admission import AUDIO_RESERVE_CHANNELS, max_audio_samples, result_bytes
from services.orchestrator.blobs.local import LocalBlobs
from services.orchestrator.job import AudioPiece, JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.request_defaults import complete_request
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import RESULT_FILE, JobRecord, JobStore
from stagediff.results import GenerationResult, ResultBuilder
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, stages_pb2
from stagekit.errors import RequestError
from tests.helpers.fake_stages import LIMITS
from tests.helpers.result_pipeline import ACME

SUCCEEDED, FAILED, RUNNING = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_RUNNING
RATE, CHANNELS = 24000, 2
AUDIO_FILE = "result-audio.npy"


def sound_limits(rate: int = RATE, channels: int = CHANNELS) -> stages_pb2.ModelLimits:
    limits = stages_pb2.ModelLimits()
    limits.CopyFrom(LIMITS)
    limits.audio_sample_rate, limits.audio_channels = rate, channels
    return limits


def chord(num_frames: int, fps: float = 16.0, rate: int = RATE) -> np.ndarray:
    """The video's length of two sines, stereo float32."""
    t = np.arange(round(num_frames / fps * rate)) / rate
    return (0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)])).astype(np.float32)


def frame_fill(index: int) -> int:
    return (index * 11 + 3) % 256


class FakeVae:
    """Decodes latent frame t into its frames (1, then 4 each), filled from each frame's index; then sends the
    sound (`sound`, or none), in small chunks, after the last frames."""

    def __init__(self, sound: np.ndarray | None, name: str = "audio") -> None:
        self.sound, self.name = sound, name

    def Decode(self, requests, timeout=None, metadata=()):
        async def run():
            assembler = TensorAssembler()
            height = width = 0
            async for request in requests:
                if request.HasField("params"):
                    continue
                latent = assembler.feed(request.tensor)
                if latent is None:
                    continue
                t = latent.index
                first, count = (0, 1) if t == 0 else (1 + 4 * (t - 1), 4)
                height, width = int(latent.array[0, 0]), int(latent.array[0, 1])
                frames = np.stack([np.full((height, width, 3), frame_fill(first + i), np.uint8) for i in range(count)])
                for chunk in encode_tensor("frames", frames, index=first):
                    yield stages_pb2.DecodeResponse(tensor=chunk)
            if self.sound is not None:
                for chunk in encode_tensor(self.name, self.sound, chunk_bytes=20_000):
                    yield stages_pb2.DecodeResponse(tensor=chunk)

        return run()


class FakeDenoiser:
    """One latent per latent frame, carrying the output size."""

    def Denoise(self, requests, timeout=None, metadata=()):
        async def run():
            params = None
            async for request in requests:
                if request.HasField("params"):
                    params = request.params
            for t in range((params.num_frames - 1) // 4 + 1):
                latent = np.array([[params.height, params.width]], np.float32)
                for chunk in encode_tensor("latents", latent, index=t):
                    yield stages_pb2.DenoiseResponse(tensor=chunk)

        return run()


class FakeInterpolator:
    """Takes every frame, remembers the names of the tensors it was sent, then sends 2**exp times the frames
    (less one) in one tensor, each frame filled as the VAE fills frame index // 2**exp."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def Interpolate(self, requests, timeout=None, metadata=()):
        async def run():
            assembler = TensorAssembler()
            frames, exp = [], 0
            async for request in requests:
                if request.HasField("params"):
                    exp = request.params.exp
                    continue
                if request.tensor.HasField("header"):
                    self.names.append(request.tensor.header.name)
                tensor = assembler.feed(request.tensor)
                if tensor is not None:
                    frames.append(tensor.array)
            video = np.concatenate(frames)
            step = 2**exp
            out = np.stack([video[i // step] for i in range((len(video) - 1) * step + 1)])
            for chunk in encode_tensor("frames", out, index=0):
                yield stages_pb2.InterpolateResponse(tensor=chunk)

        return run()


class FakeStage:
    def __init__(self, name: str, **servicers) -> None:
        self.name = name
        self.replica = SimpleNamespace(endpoint=f"fake-{name}:1", info=None, **servicers)
        self.replicas = [self.replica]

    @contextlib.asynccontextmanager
    async def call(self, *_):
        yield self.replica


class FakePool(dict):
    """The stage pool a Pipeline calls: one fake replica per stage, and one model's route."""

    def __init__(self, limits: stages_pb2.ModelLimits, sound: np.ndarray | None, name: str = "audio") -> None:
        self.interp = FakeInterpolator()
        super().__init__(
            dit=FakeStage("dit", denoiser=FakeDenoiser()),
            vae=FakeStage("vae", vae=FakeVae(sound, name)),
            interp=FakeStage("interp", interpolator=self.interp),
        )
        route = SimpleNamespace(
            family=family_named("wan-t2v"),
            info=stages_pb2.StageInfo(model="ltx", limits=limits),
            model="ltx",
            accepts=lambda *_: None,
            model_for=lambda _: "ltx",
        )
        self.routes = {"ltx": route}


class SoundPipeline(Pipeline):
    """The real Pipeline on the fake pool; the text encoder's output is taken as done (none is needed)."""

    def __init__(self, store: JobStore, pool: FakePool) -> None:
        super().__init__(stages=pool, store=store, retry_backoff_s=0.0, stage_retries=0)

    async def _run_once(self, job) -> None:
        job.intermediates.setdefault("outputs", {}).setdefault("text-encoder", [])
        await super()._run_once(job)


def sound_request(num_frames: int = 9, **fields) -> generation_pb2.GenerateRequest:
    base = dict(model="ltx", prompt="a fox", height=16, width=32, num_frames=num_frames, seed=3, fps=16.0)
    base.update(audio_codec="raw")
    return generation_pb2.GenerateRequest(**(base | fields))


def audio_chunks(events) -> list:
    return [
        event.result
        for event in events
        if event.HasField("result") and event.result.HasField("tensor") and event.result.audio_sample_rate
    ]


def sdk_result(events) -> GenerationResult:
    builder = ResultBuilder()
    results = [item for event in events for item in builder.consume(event) if isinstance(item, GenerationResult)]
    assert len(results) == 1
    return results[0]


def files(store: JobStore, job_id: str) -> list[str]:
    directory = store.jobs_dir / job_id
    return sorted(os.listdir(directory)) if directory.exists() else []


async def run_job(store: JobStore, pool: FakePool, request: generation_pb2.GenerateRequest):
    jobs = JobManager(SoundPipeline(store, pool).run, FairScheduler(), store)
    job, _ = await jobs.submit(request, ACME)
    live = [event async for event in job.follow()]
    return jobs, job, live


def test_the_sound_goes_past_the_interpolator_and_is_kept_counted_replayed_and_deleted(tmp_path: Path) -> None:
    sound = chord(9)
    pool = FakePool(sound_limits(), sound)
    request = sound_request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=1))

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs, job, live = await run_job(store, pool, request)
            assert job.state == SUCCEEDED, job.error_message
            # The interpolator saw frames only; the sound reached the result once, before its frames.
            assert set(pool.interp.names) == {"frames"}
            assert [e for e in job.events if isinstance(e, AudioPiece)] == [AudioPiece(RATE)]
            # The VAE's progress counts its frames tensors only: one per latent frame.
            vae = [e.progress for e in live if e.HasField("progress") and e.progress.stage == "vae"]
            assert [(p.step, p.total) for p in vae] == [(1, 3), (2, 3), (3, 3)]

            result = sdk_result(live)
            assert result.frames.shape == (17, 16, 32, 3) and result.fps == 32.0
            assert np.array_equal(result.audio, sound) and result.audio_sample_rate == RATE
            assert {chunk.audio_sample_rate for chunk in audio_chunks(live)} == {RATE}

            # Kept beside the frames, and counted in the tenant's bytes.
            assert files(store, job.job_id) == sorted([RESULT_FILE, AUDIO_FILE])
            stored = store.load_result(job.job_id)
            assert np.array_equal(stored.audio, sound) and stored.audio_rate == RATE
            on_disk = sum((store.jobs_dir / job.job_id / name).stat().st_size for name in (RESULT_FILE, AUDIO_FILE))
            assert store.usage("acme").finished == on_disk

            # A follower after the end, and the stored replay (the job no longer in memory), get it again.
            again = [event async for event in job.follow()]
            assert audio_chunks(again) == audio_chunks(live)
            jobs.jobs.clear()
            jobs.by_request_id.clear()
            replayed = await jobs.get(job.job_id, "acme")
            replay = [event async for event in replayed.follow()]
            assert np.array_equal(sdk_result(replay).audio, sound) and sdk_result(replay).audio_sample_rate == RATE
            assert np.array_equal(sdk_result(replay).frames, result.frames)

            assert await jobs.delete(replayed) is True
            assert not (store.jobs_dir / job.job_id).exists()
            await jobs.shutdown()

    asyncio.run(scenario())


def test_an_mp4_result_has_the_sound_as_aac(tmp_path: Path) -> None:
    sound = chord(17)
    pool = FakePool(sound_limits(), sound)
    request = sound_request(17, output_format="mp4", output_quality=65, audio_codec="aac")

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs, job, live = await run_job(store, pool, request)
            assert job.state == SUCCEEDED, job.error_message
            result = sdk_result(live)
            assert result.audio is None and result.media_type == "video/mp4"  # no raw frames asked for
            with av.open(io.BytesIO(result.data)) as container:
                assert len(container.streams.video) == 1
                stream = container.streams.audio[0]
                assert stream.codec_context.name == "aac" and stream.rate == RATE and stream.channels == CHANNELS
                decoded = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)
            # 17 frames at 16 fps: 1.0625 s, within a codec frame of priming and padding.
            assert abs(decoded.shape[1] / RATE - sound.shape[1] / RATE) <= 2048 / RATE
            # The sound file went with the raw frames; the mp4 alone is kept and counted.
            assert files(store, job.job_id) == ["result.mp4"]
            assert store.usage("acme").finished == len(result.data)
            await jobs.shutdown()

    asyncio.run(scenario())


def test_keep_raw_frames_sends_the_waveform_beside_the_mp4(tmp_path: Path) -> None:
    sound = chord(9)
    pool = FakePool(sound_limits(), sound)
    request = sound_request(output_format="webm", output_quality=65, audio_codec="", keep_raw_frames=True)
    request.audio_codec = "opus"

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs, job, live = await run_job(store, pool, request)
            assert job.state == SUCCEEDED, job.error_message
            result = sdk_result(live)
            assert np.array_equal(result.audio, sound)
            with av.open(io.BytesIO(result.data)) as container:
                assert container.streams.audio[0].codec_context.name == "opus"
            assert files(store, job.job_id) == sorted([RESULT_FILE, AUDIO_FILE, "result.webm"])
            await jobs.shutdown()

    asyncio.run(scenario())


def test_audio_codec_none_drops_the_sound(tmp_path: Path) -> None:
    pool = FakePool(sound_limits(), chord(9))

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs, job, live = await run_job(store, pool, sound_request(audio_codec="none"))
            assert job.state == SUCCEEDED, job.error_message
            assert not audio_chunks(live) and sdk_result(live).audio is None
            assert files(store, job.job_id) == [RESULT_FILE]
            await jobs.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("limits", "sound", "name", "words"),
    [
        (LIMITS, chord(9), "audio", "which makes no sound"),
        (sound_limits(channels=1), chord(9), "audio", "does not fit the sound of model 'ltx', float32 [1,"),
        (sound_limits(), np.zeros((2, 24000 * 3), np.float32), "audio", "[2, 72000] (index 0) does not fit"),
        (sound_limits(), chord(9).astype(np.float16), "audio", "a FP16 tensor"),
        (sound_limits(), None, "audio", "the VAE sent no sound"),
    ],
    ids=["model-without-sound", "channels", "too-long", "datatype", "missing"],
)
def test_sound_that_does_not_fit_fails_the_job_as_bad_data(tmp_path: Path, limits, sound, name, words) -> None:
    pool = FakePool(limits, sound, name)
    request = sound_request(audio_codec="raw" if limits.audio_sample_rate else "")

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs, job, _ = await run_job(store, pool, request)
            assert job.state == FAILED and job.error_code == grpc.StatusCode.INTERNAL
            assert "a stage sent bad data" in job.error_message and words in job.error_message, job.error_message
            assert files(store, job.job_id) == []
            await jobs.shutdown()

    asyncio.run(scenario())


def test_the_bound_on_samples_and_the_admission_reserve() -> None:
    request = sound_request(81, fps=24.0)
    # 81 frames at 24 fps: 3.375 s, a quarter and a second to spare.
    assert max_audio_samples(request, RATE) == int(np.ceil(81 / 24 * RATE * 1.25)) + RATE
    silent = sound_request(81, fps=24.0, audio_codec="none")
    reserve = max_audio_samples(request, 48000) * AUDIO_RESERVE_CHANNELS * 4
    assert result_bytes(request) - result_bytes(silent) == reserve


def _running(store: JobStore, job_id: str) -> None:
    store.insert(JobRecord.new(job_id, "acme", sound_request()))
    store.update_state(job_id, RUNNING)


def _commit(store: JobStore, job_id: str, sound: np.ndarray):
    frames = np.full((9, 16, 32, 3), 5, np.uint8)
    writer = store.create_result(job_id, frames.shape)
    writer.write(0, 0, frames.reshape(-1))
    writer.add_piece(0, 9)
    audio = store.create_audio(job_id, sound, RATE)
    store.commit_result(writer, 16.0, audio=audio)
    return writer, audio


def test_the_sound_in_a_blob_store_is_kept_counted_replayed_and_deleted(tmp_path: Path) -> None:
    blobs = LocalBlobs(tmp_path / "blobs")
    sound = chord(9)
    with JobStore.open(tmp_path / "state", blobs=blobs) as store:
        _running(store, "j")
        writer, audio = _commit(store, "j", sound)
        keys = sorted(key for key, _ in blobs.listing("j/"))
        assert keys == ["j/e1/result-audio.npy", "j/e1/result-frames.npy"]
        assert files(store, "j") == []  # the spool is gone once uploaded
        stored = store.load_result("j")
        assert stored.audio_key == "j/e1/result-audio.npy" and np.array_equal(stored.audio, sound)
        assert store.usage("acme").finished == writer.nbytes + audio.nbytes
        replay = list(stored.events("j"))
        assert np.array_equal(sdk_result(replay).audio, sound)
        # The janitor keeps what a row names.
        assert store.collect_garbage(min_age_s=0) == 0
        assert store.delete("j") is True
        store.files.close()
        assert list(blobs.listing("j/")) == []


def test_a_changed_sound_file_is_an_error_and_a_discarded_one_leaves_nothing(tmp_path: Path) -> None:
    with JobStore.open(tmp_path) as store:
        _running(store, "gone")
        audio = store.create_audio("gone", chord(9), RATE)
        audio.discard()
        assert files(store, "gone") == []
        _running(store, "j")
        _commit(store, "j", chord(9))
        with open(store.jobs_dir / "j" / AUDIO_FILE, "ab") as file:
            file.write(b"more")
        with pytest.raises(Exception, match="its sound has"):
            store.load_result("j")


def test_the_sweep_keeps_a_committed_sound_file(tmp_path: Path) -> None:
    with JobStore.open(tmp_path) as store:
        _running(store, "j")
        _commit(store, "j", chord(9))
        _running(store, "k")
        store.create_audio("k", chord(9), RATE)  # a partial file a crash leaves
    with JobStore.open(tmp_path) as store:
        assert files(store, "j") == sorted([RESULT_FILE, AUDIO_FILE])
        assert files(store, "k") == []


# ------------------------------------------------------------------------------------------- requests --

MP4, WEBM, GIF, RAW = (OUTPUT_FORMATS[name] for name in ("mp4", "webm", "gif", "raw"))


@pytest.mark.parametrize(
    ("codec", "output", "rate", "used"),
    [
        ("", MP4, RATE, "aac"),
        ("", WEBM, RATE, "opus"),
        ("", RAW, RATE, "raw"),
        ("", GIF, RATE, "none"),
        ("none", MP4, RATE, "none"),
        ("aac", MP4, RATE, "aac"),
        ("opus", WEBM, RATE, "opus"),
        ("", MP4, 0, ""),
    ],
)
def test_check_audio_completes_the_codec(codec, output, rate, used) -> None:
    assert check_audio(codec, output, "ltx", rate) == used


@pytest.mark.parametrize(
    ("codec", "output", "rate", "words"),
    [
        ("aac", MP4, 0, "audio_codec: model 'ltx' makes no sound; leave audio_codec empty"),
        ("none", MP4, 0, "model 'ltx' makes no sound"),
        ("opus", MP4, RATE, "audio_codec: output_format mp4 carries only aac; use '' or 'none' or 'aac'"),
        ("aac", WEBM, RATE, "output_format webm carries only opus"),
        ("aac", GIF, RATE, "output_format gif carries no sound; use '' or 'none'"),
        ("aac", RAW, RATE, "output_format raw carries only raw"),
        ("mp3", MP4, RATE, "audio_codec: 'mp3' is not a codec"),
    ],
)
def test_check_audio_refusals_name_the_field(codec, output, rate, words) -> None:
    with pytest.raises(ValueError) as caught:
        check_audio(codec, output, "ltx", rate)
    assert words in str(caught.value)


def _complete(limits: stages_pb2.ModelLimits, **fields) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt="a fox", **fields)
    return complete_request(request, "ltx", limits, family_named("wan-t2v"), {"text-encoder", "dit", "vae"}, None)


def test_complete_request_records_the_codec_refuses_and_notices() -> None:
    assert _complete(sound_limits(), output_format="mp4").audio_codec == "aac"
    assert _complete(LIMITS, output_format="mp4").audio_codec == ""
    with pytest.raises(RequestError, match="audio_codec: model 'ltx' makes no sound"):
        _complete(LIMITS, output_format="mp4", audio_codec="aac")
    with pytest.raises(RequestError, match="carries only opus"):
        _complete(sound_limits(), output_format="webm", audio_codec="aac")
    silent = _complete(sound_limits(), output_format="gif")
    assert silent.audio_codec == "none"
    (notice,) = silent.notices
    assert (notice.field, notice.used, notice.source) == ("audio_codec", "none", "orchestrator")
    assert "gif carries no sound" in notice.message
    assert not _complete(sound_limits(), output_format="gif", audio_codec="none").notices


def test_a_frame_rate_asking_for_more_sound_than_the_longest_video_is_refused() -> None:
    """The sound lasts as long as the video: at most max_frames (33) at the model's default 16 fps, 2.06 s."""
    assert _complete(sound_limits(), num_frames=33, fps=16.0).fps == 16.0
    assert _complete(sound_limits(), num_frames=17, fps=8.5).fps == 8.5  # 2 s
    with pytest.raises(RequestError, match=r"^fps: 17 frames at 8 fps last 2.12 s; this model makes at most 2.06 s"):
        _complete(sound_limits(), num_frames=17, fps=8.0)
    assert _complete(LIMITS, num_frames=17, fps=0.5).fps == 0.5  # a silent model's video may be slow


# ------------------------------------------------------------------------------------------------ SDK --


def test_the_sdk_assembles_the_sound_and_writes_it_as_wav(tmp_path: Path) -> None:
    sound = chord(5)
    events = [
        generation_pb2.GenerateEvent(result=generation_pb2.ResultChunk(tensor=chunk, fps=16.0), job_id="j")
        for chunk in encode_tensor("frames", np.zeros((5, 4, 4, 3), np.uint8), index=0)
    ]
    events += [
        generation_pb2.GenerateEvent(
            job_id="j", result=generation_pb2.ResultChunk(tensor=chunk, fps=16.0, audio_sample_rate=RATE)
        )
        for chunk in encode_tensor("audio", sound, chunk_bytes=4096)
    ]
    events.append(
        generation_pb2.GenerateEvent(job_id="j", completed=generation_pb2.JobCompleted(num_frames=5, fps=16.0))
    )
    result = sdk_result(events)
    assert result.frames.shape == (5, 4, 4, 3)
    assert result.audio.dtype == np.float32 and np.array_equal(result.audio, sound)
    assert result.audio_sample_rate == RATE and "audio [2, 7500] at 24000 Hz" in repr(result)
    path = result.save(tmp_path / "out.wav")
    with wave.open(str(path)) as read:
        assert (read.getnchannels(), read.getframerate(), read.getnframes()) == (2, RATE, sound.shape[1])
    silent = GenerationResult("k", np.zeros((1, 4, 4, 3), np.uint8), 16.0)
    assert silent.audio is None and silent.audio_sample_rate == 0
    with pytest.raises(ValueError, match="no sound"):
        silent.save(tmp_path / "silent.wav")


def test_the_cli_writes_the_sound_beside_raw_frames(tmp_path: Path, capsys) -> None:
    import json

    from stagediff.client_commands import _save

    sound = chord(5)
    result = GenerationResult("j", np.zeros((5, 4, 4, 3), np.uint8), 16.0, audio=sound, audio_sample_rate=RATE)
    assert _save(result, tmp_path / "clip.npz", 0.0) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["audio"] == {"sample_rate": RATE, "channels": 2, "samples": sound.shape[1]}
    assert summary["audio_out"] == str(tmp_path / "clip.wav") and (tmp_path / "clip.wav").is_file()
