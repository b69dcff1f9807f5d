"""Encoded results (GenerateRequest.output_format): the format checks, the streaming encoder, the store's
encoded files, and jobs whose followers receive an MP4 while its later frames are still being made.

The orchestrator's real JobManager, Pipeline, ResultPublisher and EncodedResult run here with the stage calls
replaced (`FramePipeline` from test_result_spool.py); no model and no cluster.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from services.encoding import OUTPUT_FORMATS, ResultEncoder, check_output
from services.orchestrator.job import STAGE_WEIGHTS, EncodedPiece, Job, JobState, ResultPiece
from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import RESULT_FILE, JobRecord, JobStore, StoreError, Usage
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2
from tests.helpers.result_pipeline import ACME, FramePipeline, assemble, expected_frames, make_request, vae_pieces

SUCCEEDED, FAILED, RUNNING = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_RUNNING
MP4 = "video/mp4"


def smooth_clip(count: int, height: int, width: int) -> np.ndarray:
    """A clip of soft gradients drifting a little per frame: what a video codec encodes well."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = np.empty((count, height, width, 3), np.uint8)
    for t in range(count):
        frames[t, ..., 0] = 128 + 100 * np.sin((x + 2 * t) / 9.0)
        frames[t, ..., 1] = 128 + 100 * np.cos((y + t) / 7.0)
        frames[t, ..., 2] = 128 + 60 * np.sin((x + y - 3 * t) / 13.0)
    return frames


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def decode(data: bytes) -> tuple[np.ndarray, Fraction | None]:
    """Every frame of a video file as RGB [F, H, W, 3], and its stream's average rate."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(frames), stream.average_rate


def encode(name: str, frames: np.ndarray, *, quality: int | None = None, fps: float = 16.0, step: int = 4):
    """(bytes, sizes of what each add returned, what finish returned) of `frames` fed `step` at a time."""
    encoder = ResultEncoder(OUTPUT_FORMATS[name], quality, frames.shape[1], frames.shape[2], fps)
    parts = [encoder.add(frames[i : i + step]) for i in range(0, len(frames), step)]
    tail = encoder.finish()
    return b"".join(parts) + tail, [len(part) for part in parts], tail


# ------------------------------------------------------------- checks --


@pytest.mark.parametrize(
    ("name", "quality", "keep_raw", "num_frames", "field", "words"),
    [
        ("mov", None, False, 9, "output_format", "is not a format"),
        ("png", 80, False, 1, "output_quality", "takes no quality"),
        ("gif", 80, False, 9, "output_quality", "takes no quality"),
        ("raw", 80, False, 9, "output_quality", "takes no quality"),
        ("", 80, False, 9, "output_quality", "takes no quality"),
        ("mp4", 0, False, 9, "output_quality", "1 (smallest) to 100"),
        ("jpeg", 101, False, 1, "output_quality", "1 (smallest) to 100"),
        ("raw", None, True, 9, "keep_raw_frames", "encoded format"),
        ("", None, True, 9, "keep_raw_frames", "encoded format"),
        ("png", None, False, 9, "output_format", "one image"),
        ("webp", 50, False, 2, "output_format", "one image"),
    ],
)
def test_check_output_refusals_name_the_field(name, quality, keep_raw, num_frames, field, words) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        check_output(name, quality, keep_raw, num_frames)
    assert str(refused.value).startswith(f"{field}: ")


def test_check_output_accepts_formats_that_agree_with_the_request() -> None:
    assert check_output("", None, False, 81).name == "raw"
    assert check_output("mp4", None, True, 81).media_type == MP4
    assert check_output("mp4", 1, False, 81).default_quality == 65
    assert check_output("webm", 100, False, 1).extension == ".webm"
    assert check_output("gif", None, False, 5).media_type == "image/gif"
    assert check_output("png", None, True, 1).media_type == "image/png"
    assert check_output("jpeg", 90, False, 1).extension == ".jpg"


def test_the_encoder_refuses_what_it_cannot_encode() -> None:
    with pytest.raises(ValueError, match="raw frames are not encoded"):
        ResultEncoder(OUTPUT_FORMATS["raw"], None, 8, 8, 16.0)
    encoder = ResultEncoder(OUTPUT_FORMATS["mp4"], None, 16, 16, 16.0)
    with pytest.raises(ValueError, match="no frames were encoded"):
        encoder.finish()
    with pytest.raises(ValueError, match=r"this encoder takes \[n, 16, 16, 3\]"):
        encoder.add(np.zeros((1, 16, 8, 3), np.uint8))
    encoder.close()
    image = ResultEncoder(OUTPUT_FORMATS["png"], None, 8, 8, 16.0)
    with pytest.raises(ValueError, match="exactly one frame"):
        image.add(np.zeros((2, 8, 8, 3), np.uint8))


# ------------------------------------------------------------ encoder --


def test_mp4_streams_before_finish_and_decodes_to_the_clip() -> None:
    frames = smooth_clip(40, 64, 96)
    data, sizes, tail = encode("mp4", frames)
    # A fragmented MP4: bytes come out while later frames are still to be fed, not only at the end.
    assert any(sizes), f"every add returned nothing: {sizes}"
    assert sum(sizes) > 0 and tail
    decoded, rate = decode(data)
    assert decoded.shape == frames.shape
    assert rate == 16
    assert psnr(decoded, frames) > 30


def test_odd_sizes_are_padded_by_one_row_and_column() -> None:
    frames = smooth_clip(8, 63, 95)
    data, _, _ = encode("mp4", frames, fps=24.0)
    decoded, rate = decode(data)
    assert decoded.shape == (8, 64, 96, 3) and rate == 24
    # The padding repeats the last row and column; the frames themselves are where they were.
    assert psnr(decoded[:, :63, :95], frames) > 30
    assert psnr(decoded[:, 63, :95], frames[:, 62]) > 25
    assert psnr(decoded[:, :63, 95], frames[:, :, 94]) > 25


def test_mp4_quality_trades_size_for_fidelity() -> None:
    frames = smooth_clip(24, 64, 64)
    default, _, _ = encode("mp4", frames)
    better, _, _ = encode("mp4", frames, quality=95)
    worse, _, _ = encode("mp4", frames, quality=10)
    assert len(worse) < len(default) < len(better)
    assert psnr(decode(default)[0], frames) > 30
    assert psnr(decode(better)[0], frames) > psnr(decode(default)[0], frames) > psnr(decode(worse)[0], frames)


def test_a_fractional_frame_rate_is_kept() -> None:
    frames = smooth_clip(6, 32, 32)
    data, _, _ = encode("mp4", frames, fps=30000 / 1001)
    assert decode(data)[1] == Fraction(30000, 1001)


@pytest.mark.parametrize("name", ["webm", "gif"])
def test_webm_and_gif_decode_to_every_frame(name: str) -> None:
    frames = smooth_clip(13, 32, 48)
    data, _, _ = encode(name, frames, step=5)
    decoded, _ = decode(data)
    assert decoded.shape == frames.shape
    assert psnr(decoded, frames) > 20  # gif: a 256-colour palette


def chord(seconds: float, rate: int) -> np.ndarray:
    """Two rising sweeps, one per channel (no period, so an offset aligns them once): float32 [2, n]."""
    t = np.arange(round(seconds * rate)) / rate
    sweeps = [np.sin(2 * np.pi * (start * t + 600 * t**2)) for start in (300, 450)]
    return (0.4 * np.stack(sweeps)).astype(np.float32)


def decoded_sound(data: bytes) -> tuple[np.ndarray, int, float]:
    """The file's sound [channels, n] as decoded, its sample rate and its stream's duration in seconds."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        sound = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)
        duration = float(stream.duration * stream.time_base) if stream.duration else sound.shape[1] / stream.rate
        return sound, stream.rate, duration


@pytest.mark.parametrize(("name", "codec"), [("mp4", "aac"), ("webm", "opus")])
def test_sound_is_muxed_beside_the_video(name: str, codec: str) -> None:
    """0.5 s of stereo at 24 kHz beside 12 frames at 24 fps, the sound added before the frames: the file has both
    streams, the sound at its rate and channels, about its duration (a codec frame of priming and padding at most),
    and the sweeps themselves (aligned by cross-correlation, 20 dB above the coding noise)."""
    from services.encoding import AudioTrack

    frames, sound = smooth_clip(12, 48, 64), chord(0.5, 24000)
    encoder = ResultEncoder(OUTPUT_FORMATS[name], None, 48, 64, 24.0, audio=AudioTrack(24000, 2))
    data = encoder.add_audio(sound) + encoder.add(frames[:6]) + encoder.add(frames[6:]) + encoder.finish()
    video, _ = decode(data)
    assert video.shape == frames.shape and psnr(video, frames) > 30
    decoded, rate, duration = decoded_sound(data)
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].codec_context.name == codec
        assert container.streams.audio[0].channels == 2
    # Opus decodes at 48 kHz whatever it was given; AAC at the given rate.
    assert rate == (48000 if codec == "opus" else 24000)
    assert abs(duration - 0.5) <= 2048 / rate, duration
    reference = chord(0.5, rate)
    window = reference[0, : rate // 10]
    offset = max(range(0, 4096), key=lambda k: float(np.dot(decoded[0, k : k + window.size], window)))
    aligned = decoded[:, offset : offset + reference.shape[1] - 2048]
    part = reference[:, : aligned.shape[1]]
    snr = 10 * np.log10(np.mean(part**2) / np.mean((aligned - part) ** 2))
    print(f"{name}: sound {duration:.3f} s at {rate} Hz, offset {offset}, {snr:.1f} dB")
    assert snr > 20


def test_sound_is_refused_where_the_format_carries_none() -> None:
    from services.encoding import AudioTrack

    with pytest.raises(ValueError, match="gif carries no sound"):
        ResultEncoder(OUTPUT_FORMATS["gif"], None, 8, 8, 16.0, audio=AudioTrack(24000, 2))
    encoder = ResultEncoder(OUTPUT_FORMATS["mp4"], None, 16, 16, 16.0, audio=AudioTrack(24000, 1))
    with pytest.raises(ValueError, match=r"float32 \[1, n\]"):
        encoder.add_audio(chord(0.1, 24000))
    with pytest.raises(ValueError, match="NaN"):
        encoder.add_audio(np.full((1, 10), np.nan, np.float32))
    silent = ResultEncoder(OUTPUT_FORMATS["mp4"], None, 16, 16, 16.0)
    with pytest.raises(ValueError, match="without a sound track"):
        silent.add_audio(chord(0.1, 24000)[:1])
    encoder.close()
    silent.close()


def test_png_is_lossless_and_jpeg_and_webp_keep_the_size() -> None:
    (frame,) = smooth_clip(1, 45, 67)
    frame[0, 0] = [255, 0, 7]
    data, sizes, _ = encode("png", frame[None])
    assert sizes == [0] and data.startswith(b"\x89PNG")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), frame)
    for name, magic in (("jpeg", b"\xff\xd8"), ("webp", b"RIFF")):
        small, _, _ = encode(name, frame[None], quality=5)
        data, _, _ = encode(name, frame[None])
        assert data.startswith(magic) and len(small) < len(data)
        decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert decoded.shape == frame.shape and psnr(decoded, frame) > 30


# -------------------------------------------------------------- store --


@pytest.fixture
def store(tmp_path: Path):
    with JobStore.open(tmp_path / "state") as opened:
        yield opened


def _running(store: JobStore, job_id: str, seed: int = 5) -> None:
    request = generation_pb2.GenerateRequest(height=8, width=16, num_frames=9, seed=seed, output_format="mp4")
    store.insert(JobRecord.new(job_id, "acme", request))
    store.update_state(job_id, RUNNING)


def _frames(count: int = 9) -> np.ndarray:
    frames = np.full((count, 8, 16, 3), 7, np.uint8)
    frames[:, 0, 0, 0] = np.arange(count)
    return frames


def _write(store: JobStore, job_id: str, encoded_data: bytes, *, keep_raw: bool):
    """A running job's raw and encoded files written and committed; returns (raw writer, encoded writer)."""
    frames = _frames()
    writer = store.create_result(job_id, frames.shape)
    encoded = store.create_encoded(job_id, ".mp4", MP4)
    writer.write(0, 0, frames[:1].reshape(-1))
    writer.add_piece(0, 1)
    assert encoded.append(encoded_data[:100]) == 0
    writer.write(1, 0, frames[1:].reshape(-1))
    writer.add_piece(1, 8)
    assert encoded.append(encoded_data[100:]) == 100
    assert encoded.size == len(encoded_data)
    store.commit_result(writer, 16.0, encoded=encoded, keep_raw=keep_raw, timings={"total": 2.0})
    return writer, encoded


def _files(store: JobStore, job_id: str) -> list[str]:
    directory = store.jobs_dir / job_id
    return sorted(os.listdir(directory)) if directory.exists() else []


def _encoded_bytes(events: list[generation_pb2.GenerateEvent], media_type: str = MP4) -> bytes:
    """The file the encoded chunks make, checking that they come in order and end once."""
    chunks = [event.result.encoded for event in events if event.HasField("result") and event.result.HasField("encoded")]
    assert chunks, "no encoded chunks"
    offset = 0
    for chunk in chunks:
        assert chunk.offset == offset and chunk.media_type == media_type
        offset += len(chunk.data)
    assert [chunk.last for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    return b"".join(chunk.data for chunk in chunks)


def test_an_encoded_result_without_its_raw_frames(store: JobStore) -> None:
    _running(store, "j")
    data = os.urandom(2500)
    _write(store, "j", data, keep_raw=False)
    assert _files(store, "j") == ["result.mp4"]  # the raw frames are deleted, no partial file is left
    result = store.load_result("j")
    assert result.path is None and result.encoded_path == store.jobs_dir / "j" / "result.mp4"
    assert (result.media_type, result.encoded_bytes, result.num_frames) == (MP4, 2500, 9)
    assert result.encoded_bytes == result.encoded_path.stat().st_size
    assert store.usage("acme") == Usage(finished=2500, active=0)
    with pytest.raises(Exception, match="only its encoded file"):
        result.open()

    events = list(result.events("j", seed=5, chunk_bytes=1000))
    assert all(event.job_id == "j" for event in events)
    *chunks, completed = events
    assert len(chunks) == 3 and all(e.result.HasField("encoded") and not e.result.HasField("tensor") for e in chunks)
    assert all(e.result.fps == 16.0 for e in chunks)
    assert _encoded_bytes(chunks) == data == result.encoded_path.read_bytes()
    assert completed.HasField("completed")
    assert (completed.completed.media_type, completed.completed.encoded_bytes, completed.completed.seed) == (
        MP4,
        2500,
        5,
    )
    assert completed.completed.num_frames == 9 and completed.completed.timings == {"total": 2.0}


def test_an_encoded_result_that_keeps_its_raw_frames(store: JobStore) -> None:
    _running(store, "j")
    data = os.urandom(1500)
    writer, _ = _write(store, "j", data, keep_raw=True)
    assert _files(store, "j") == sorted([RESULT_FILE, "result.mp4"])
    result = store.load_result("j")
    assert result.path == store.jobs_dir / "j" / RESULT_FILE and np.array_equal(result.frames, _frames())
    assert store.usage("acme") == Usage(finished=writer.nbytes + 1500, active=0)

    events = list(result.events("j", seed=5, chunk_bytes=1000))
    kinds = ["tensor" if e.result.HasField("tensor") else "encoded" for e in events[:-1]]
    # The raw frames first, as first published, then the encoded file, then completion.
    expected = [
        *encode_tensor("frames", _frames()[:1], index=0, chunk_bytes=1000),
        *encode_tensor("frames", _frames()[1:], index=1, chunk_bytes=1000),
    ]
    assert kinds == ["tensor"] * len(expected) + ["encoded"] * 2
    assert [e.result.tensor for e in events[: len(expected)]] == expected
    assert _encoded_bytes(events) == data
    assert events[-1].completed.encoded_bytes == 1500

    assert store.delete("j") is True
    assert not (store.jobs_dir / "j").exists() and store.load_result("j") is None


def test_a_changed_encoded_file_is_an_error(store: JobStore) -> None:
    _running(store, "j")
    _write(store, "j", b"x" * 300, keep_raw=False)
    path = store.jobs_dir / "j" / "result.mp4"
    path.write_bytes(b"x" * 299)
    with pytest.raises(StoreError, match="has 299 bytes, its record says 300"):
        store.load_result("j")
    path.unlink()
    with pytest.raises(StoreError, match="encoded result cannot be read"):
        store.load_result("j")


def test_create_encoded_needs_a_running_job_and_a_plain_extension(store: JobStore) -> None:
    _running(store, "j")
    for wrong in ("mp4", ".MP4", "./x", ".mp4/../x"):
        with pytest.raises(ValueError, match="extension"):
            store.create_encoded("j", wrong, MP4)
    store.update_state("j", FAILED, error_code=13)
    with pytest.raises(StoreError, match="not JOB_STATE_RUNNING"):
        store.create_encoded("j", ".mp4", MP4)


def test_a_discarded_encoded_file_leaves_nothing(store: JobStore) -> None:
    _running(store, "j")
    encoded = store.create_encoded("j", ".webm", "video/webm")
    encoded.append(b"abc")
    reader = encoded.open_reader()
    encoded.discard()
    assert _files(store, "j") == []
    assert [chunk.data for chunk in reader.chunks(0, 3, last=False)] == [b"abc"]  # an open reader finishes
    reader.close()
    with pytest.raises(Exception, match="discarded"):
        encoded.open_reader()


def test_the_sweep_keeps_committed_encoded_files_and_removes_partial_ones(tmp_path: Path) -> None:
    with JobStore.open(tmp_path) as store:
        _running(store, "done")
        _write(store, "done", b"m" * 200, keep_raw=False)
        _running(store, "crashed")
        store.create_result("crashed", (9, 8, 16, 3)).discard()
        partial = store.create_encoded("crashed", ".mp4", MP4)
        partial.append(b"half a video")
        (name,) = _files(store, "crashed")
        assert name.startswith(".result.mp4.") and name.endswith(".partial")
    # The process died with the encoded file half written: the next open removes it and keeps the other.
    with JobStore.open(tmp_path) as store:
        assert _files(store, "done") == ["result.mp4"] and _files(store, "crashed") == []
        assert store.load_result("done").encoded_bytes == 200
    partial.discard()


# ------------------------------------------------------- jobs and pipeline --


def encoded_request(num_frames: int = 41, *, keep_raw: bool = False, seed: int = 2) -> generation_pb2.GenerateRequest:
    """A request as the orchestrator completes it for mp4: format, default quality, size, fps."""
    request = make_request(num_frames, height=32, width=48, seed=seed)
    request.output_format = "mp4"
    request.output_quality = 65
    request.keep_raw_frames = keep_raw
    return request


class Follower:
    """Follows a job in its own task; `first_encoded` is set when the first encoded chunk arrives."""

    def __init__(self) -> None:
        self.events: list[generation_pb2.GenerateEvent] = []
        self.first_encoded = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self, job: Job) -> None:
        self.task = asyncio.create_task(self._follow(job))

    async def _follow(self, job: Job) -> None:
        async for event in job.follow():
            self.events.append(event)
            if event.HasField("result") and event.result.HasField("encoded"):
                self.first_encoded.set()


def streamed_pipeline(store: JobStore, follower: Follower, last_piece: int) -> FramePipeline:
    """A FramePipeline that publishes its last piece only once `follower` has received encoded bytes."""

    async def before_piece(job, first: int) -> None:
        if first == last_piece:
            await asyncio.wait_for(follower.first_encoded.wait(), timeout=30)
            assert not job.finished

    return FramePipeline(store, before_piece)


def open_job_files(store: JobStore) -> list[str]:
    """The files under the store's jobs folder this process holds open (deleted ones included)."""
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{store.jobs_dir}{os.sep}"):
            opened.append(target)
    return opened


def _tensor_chunks(events) -> list:
    return [e.result.tensor for e in events if e.HasField("result") and e.result.HasField("tensor")]


def test_a_live_follower_receives_the_mp4_while_the_frames_are_made(tmp_path: Path) -> None:
    request = encoded_request()
    last_piece = vae_pieces(41)[-1][0]

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            follower = Follower()
            jobs = JobManager(streamed_pipeline(store, follower, last_piece).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            follower.start(job)
            await job.task
            await follower.task
            assert job.state == SUCCEEDED, job.error_message
            live = follower.events
            assert not _tensor_chunks(live)  # the raw frames are neither sent...
            assert _files(store, job.job_id) == ["result.mp4"]  # ...nor kept
            # The log holds the markers: a ResultPiece per piece, an EncodedPiece per part of the file.
            assert [(e.first, e.count) for e in job.events if isinstance(e, ResultPiece)] == vae_pieces(41)
            assert any(isinstance(e, EncodedPiece) and not e.last for e in job.events)
            data = _encoded_bytes(live)
            completed = live[-1].completed
            assert (completed.media_type, completed.encoded_bytes, completed.seed) == (MP4, len(data), 2)
            assert completed.num_frames == 41 and completed.fps == 16.0
            assert data == (store.jobs_dir / job.job_id / "result.mp4").read_bytes()
            decoded, rate = decode(data)
            assert decoded.shape == (41, 32, 48, 3) and rate == 16
            assert psnr(decoded, expected_frames(request)) > 30
            assert job.to_proto().media_type == MP4 and job.to_proto().progress_percent == 100.0
            assert open_job_files(store) == []  # the encoder's reader of the raw frames was closed
            # A watcher after completion, while the job is still in memory, reads the committed file.
            again = [event async for event in job.follow()]
            assert not _tensor_chunks(again) and _encoded_bytes(again) == data

            # Once the job has left memory, a watcher replays the same bytes and completion from the store.
            jobs.jobs.clear()
            jobs.by_request_id.clear()
            stored = await jobs.get(job.job_id, "acme")
            assert stored.stored_in is store
            replay = [event async for event in stored.follow()]
            assert not _tensor_chunks(replay)
            assert _encoded_bytes(replay) == data
            assert replay[-1] == live[-1]

    asyncio.run(scenario())


def test_keep_raw_frames_sends_and_keeps_both(tmp_path: Path) -> None:
    request = encoded_request(21, keep_raw=True)

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs = JobManager(FramePipeline(store).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            live = [event async for event in job.follow()]
            assert job.state == SUCCEEDED, job.error_message
            assert _files(store, job.job_id) == sorted([RESULT_FILE, "result.mp4"])
            frames, pieces = assemble(e for e in live if not e.HasField("result") or e.result.HasField("tensor"))
            assert np.array_equal(frames, expected_frames(request)) and pieces == vae_pieces(21)
            data = _encoded_bytes(live)
            assert psnr(decode(data)[0], expected_frames(request)) > 30
            result = store.load_result(job.job_id)
            assert store.usage("acme").finished == result.path.stat().st_size + len(data)

            # A watcher after completion (job still in memory) gets the same; so does the stored replay.
            again = [event async for event in job.follow()]
            assert _tensor_chunks(again) == _tensor_chunks(live) and _encoded_bytes(again) == data
            jobs.jobs.clear()
            jobs.by_request_id.clear()
            stored = await jobs.get(job.job_id, "acme")
            replay = [event async for event in stored.follow()]
            assert _tensor_chunks(replay) == _tensor_chunks(live) and _encoded_bytes(replay) == data

            assert await jobs.delete(stored) is True
            assert not (store.jobs_dir / job.job_id).exists() and store.get(job.job_id) is None

    asyncio.run(scenario())


def test_an_image_job_sends_its_file_once_at_the_end(tmp_path: Path) -> None:
    request = make_request(1, height=24, width=40, seed=9)
    request.output_format = "png"

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            jobs = JobManager(FramePipeline(store).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            live = [event async for event in job.follow()]
            assert job.state == SUCCEEDED, job.error_message
            assert [e for e in job.events if isinstance(e, EncodedPiece)] == [
                EncodedPiece(0, live[-1].completed.encoded_bytes, True)
            ]
            data = _encoded_bytes(live, "image/png")
            image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            assert np.array_equal(image, expected_frames(request)[0])
            assert _files(store, job.job_id) == ["result.png"]
            assert live[-1].completed.media_type == "image/png"

    asyncio.run(scenario())


def test_a_job_that_fails_mid_way_leaves_no_encoded_file(tmp_path: Path) -> None:
    request = encoded_request()
    last_piece = vae_pieces(41)[-1][0]

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            follower = Follower()

            async def fail_at_the_end(job, first: int) -> None:
                if first == last_piece:
                    await asyncio.wait_for(follower.first_encoded.wait(), timeout=30)
                    raise StoreError("the disk went away")

            jobs = JobManager(FramePipeline(store, fail_at_the_end).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            follower.start(job)
            await job.task
            await follower.task
            assert job.state == FAILED and "the disk went away" in job.error_message
            assert any(isinstance(e, EncodedPiece) for e in job.events)  # some of the file had been sent
            assert _files(store, job.job_id) == []  # no .partial of either file is left
            assert store.load_result(job.job_id) is None
            assert open_job_files(store) == []
            # A watcher that comes late sees the error and no bytes of the deleted file.
            late = [event async for event in job.follow()]
            assert not any(event.HasField("result") for event in late)

    asyncio.run(scenario())


def test_a_cancelled_job_leaves_no_file_open_or_behind(tmp_path: Path) -> None:
    request = encoded_request()

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:
            reached = asyncio.Event()

            async def hang_mid_way(job, first: int) -> None:
                if first == 21:
                    reached.set()
                    await asyncio.sleep(3600)

            jobs = JobManager(FramePipeline(store, hang_mid_way).run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            await asyncio.wait_for(reached.wait(), timeout=30)
            await jobs.cancel(job)
            await asyncio.gather(job.task, return_exceptions=True)
            assert job.state == JobState.JOB_STATE_CANCELLED
            assert _files(store, job.job_id) == []
            assert open_job_files(store) == []

    asyncio.run(scenario())


@pytest.mark.parametrize("output", ["", "mp4"])
def test_a_job_whose_commit_fails_fails_cleanly(tmp_path: Path, output: str) -> None:
    request = encoded_request(9)
    request.output_format = output
    if not output:
        request.ClearField("output_quality")

    async def scenario() -> None:
        with JobStore.open(tmp_path) as store:

            def commit_fails(*args, **kwargs):
                raise StoreError("no space left on the state volume")

            store.commit_result = commit_fails
            pipeline = FramePipeline(store)
            raised: list[BaseException] = []

            async def run(job) -> None:
                try:
                    await pipeline.run(job)
                except Exception as error:
                    raised.append(error)
                    raise

            jobs = JobManager(run, FairScheduler(), store)
            job, _ = await jobs.submit(request, ACME)
            await job.task
            assert job.state == FAILED and "could not store the result" in job.error_message
            assert _files(store, job.job_id) == []
            assert store.get(job.job_id).state == FAILED, "the store still says RUNNING"
            assert raised == []  # Pipeline.run records the failure and never raises...
            assert store.get(job.job_id).state == FAILED  # ...so the manager stores the outcome

    asyncio.run(scenario())


def _progress(stage: str, step: int, total: int) -> generation_pb2.GenerateEvent:
    return generation_pb2.GenerateEvent(progress=generation_pb2.StageProgress(stage=stage, step=step, total=total))


def test_progress_percent_weighs_each_stage_of_the_chain() -> None:
    async def scenario() -> None:
        job = Job("j", encoded_request(9))
        assert job.progress_percent() == 0.0  # queued, no chain yet
        job.chain = ("text-encoder", "dit", "vae")
        assert job.progress_percent() == 0.0
        total = STAGE_WEIGHTS["text-encoder"] + STAGE_WEIGHTS["dit"] + STAGE_WEIGHTS["vae"]
        job.state = RUNNING
        await job.publish(_progress("text-encoder", 1, 1))
        assert job.progress_percent() == round(100 * STAGE_WEIGHTS["text-encoder"] / total, 1)
        await job.publish(_progress("dit", 5, 20))
        await job.publish(_progress("dit", 10, 20))  # the latest step counts
        done = STAGE_WEIGHTS["text-encoder"] + STAGE_WEIGHTS["dit"] / 2
        assert job.progress_percent() == round(100 * done / total, 1)
        await job.publish(_progress("interp", 3, 3))  # not in the chain: ignored
        assert job.progress_percent() == round(100 * done / total, 1)
        job.current_stage = "dit"
        proto = job.to_proto()
        assert proto.progress_percent == pytest.approx(round(100 * done / total, 1))
        assert (proto.progress.stage, proto.progress.step, proto.progress.total) == ("dit", 10, 20)
        await job.publish(_progress("dit", 20, 20))
        await job.publish(_progress("vae", 2, 2))
        assert job.progress_percent() == 100.0
        job.state = SUCCEEDED
        assert job.progress_percent() == 100.0 and job.to_proto().media_type == MP4

    asyncio.run(scenario())
