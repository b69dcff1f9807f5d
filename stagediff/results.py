"""What a generate call gives back: the events of a job's stream (`Queued`, `Progress`, `FramesReceived`,
`BytesReceived`), its `GenerationResult` with the `Notice`s of what was changed in the request, and the
`ResultBuilder` that turns the stream's messages into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from stagediff.errors import InternalError
from stagediff.media import SUPPORTED_EXTENSIONS, decode_media
from stagediff.protocol import MEDIA_TYPE_EXTENSIONS
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import generation_pb2, stages_pb2

AUDIO_TENSOR = "audio"  # the result tensor that holds a result's sound (ResultChunk in generation.proto)


@dataclass
class Queued:
    """The job waits in the orchestrator's queue; `position` 0 runs next."""

    job_id: str
    position: int


@dataclass
class Progress:
    """A stage ("text-encoder", "dit", "vae", "interp") finished `step` of its `total` steps."""

    job_id: str
    stage: str
    step: int
    total: int


@dataclass
class Paused:
    """The job's denoising stopped at step `step` of `total`, its state kept: `reason` "preempted" (a job of a
    higher priority class took its DiT slot; `preemptions` counts them) or "handoff" (its DiT replica is shutting
    down). It resumes from that step (`Resumed`), never from the start."""

    job_id: str
    stage: str
    step: int
    total: int
    reason: str
    preemptions: int


@dataclass
class Resumed:
    """The job's denoising continues from step `step` of `total`."""

    job_id: str
    stage: str
    step: int
    total: int


@dataclass
class FramesReceived:
    """Raw frames `first_frame` .. `first_frame + count - 1` of the result arrived."""

    job_id: str
    first_frame: int
    count: int


@dataclass
class BytesReceived:
    """`count` bytes of the encoded result arrived, from byte `offset` of the file."""

    job_id: str
    offset: int
    count: int


@dataclass(frozen=True)
class Notice:
    """A change made to the request that its caller did not ask for, e.g. the prompt truncated to the tokens the
    text encoder takes: the request `field`, what was `given` and what was `used` instead (each with its unit,
    "721 tokens"), a sentence for a person (`message`) and who made the change (`source`: "text-encoder",
    "orchestrator", or a front end such as "http")."""

    field: str
    given: str
    used: str
    message: str
    source: str

    @classmethod
    def from_proto(cls, notice: stages_pb2.Notice) -> Notice:
        return cls(notice.field, notice.given, notice.used, notice.message, notice.source)


class GenerationResult:
    """A finished job's result: its frames, or the file the server encoded, or both.

    `frames` are uint8 RGB [F, H, W, 3]. A result the server encoded (the request named an `output_format`)
    holds the file in `data` and its `media_type` ("video/mp4", "image/png", ...); its `frames` are decoded
    from `data` on first access (PyAV for mp4, webm and gif; Pillow for png, jpeg and webp), unless the raw
    frames came too (`keep_raw_frames`). A raw result has `data` None and `media_type` "".
    A result with sound (a model that makes video with sound, such as LTX-2) has its waveform in `audio`
    (float32 [channels, samples]) at `audio_sample_rate` when the raw frames came, and muxed in `data` for
    mp4 (AAC) and webm (Opus).
    """

    def __init__(
        self,
        job_id: str,
        frames: np.ndarray | None = None,
        fps: float = 0.0,
        timings: dict[str, float] | None = None,
        passes_run: int = 0,
        passes_skipped: int = 0,
        *,
        data: bytes | None = None,
        media_type: str = "",
        seed: int | None = None,
        num_frames: int | None = None,
        notices: list[Notice] | None = None,
        audio: np.ndarray | None = None,
        audio_sample_rate: int = 0,
    ) -> None:
        """`frames` or `data` (with its `media_type`) or both; `num_frames` defaults to the frames' count.
        `audio`: the sound's waveform, float32 [channels, samples] at `audio_sample_rate`, for a result with sound."""
        if frames is None and data is None:
            raise ValueError("frames: give the frames, or data (an encoded file with its media_type), or both")
        self.job_id = job_id
        self._frames = frames
        self.fps = fps
        self.timings = dict(timings or {})
        # Transformer passes (one per step and guidance branch) the DiT ran in full, and those its step cache skipped.
        self.passes_run = passes_run
        self.passes_skipped = passes_skipped
        self.data = data
        self.media_type = media_type
        # The seed the job ran with: the request's, or the one the server picked.
        self.seed = seed
        # The number of frames the server reported.
        self.num_frames = num_frames if num_frames is not None else len(frames) if frames is not None else 0
        # What was changed in the request without the caller asking (a truncated prompt), in the order it was made.
        self.notices = list(notices or [])
        # The sound of a model that makes video with sound (LTX-2): float32 [channels, samples] in [-1, 1] at
        # `audio_sample_rate` samples per second, beside the raw frames (output_format raw, or keep_raw_frames);
        # None for a silent result, or an encoded one without its raw frames (its sound is muxed in `data`).
        self.audio = audio
        self.audio_sample_rate = audio_sample_rate if audio is not None else 0

    @property
    def frames(self) -> np.ndarray:
        """uint8 RGB frames [F, H, W, 3]; an encoded result is decoded on first access."""
        if self._frames is None:
            assert self.data is not None  # a result has frames or data
            self._frames = decode_media(self.data, self.media_type)
        return self._frames

    def save(self, path: str | Path) -> Path:
        """Writes the result to `path`; parent directories are created. Returns the path.

        An encoded result is written as it is when the extension is its media type's (.mp4 for video/mp4;
        .webm, .gif, .png, .jpg or .jpeg, .webp likewise). Otherwise the frames are written by extension: .mp4
        (H.264), .png (one frame) or .npz (lossless `frames` and `fps`); .wav writes the sound (16-bit PCM) of a
        result that has `audio`.
        """
        from stagediff.media import save_frames

        path = Path(path)
        extension = path.suffix.lower()
        if extension == ".wav":
            return self.save_audio(path)
        if self.data is not None and extension in MEDIA_TYPE_EXTENSIONS.get(self.media_type, ()):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.data)
            return path
        if extension not in SUPPORTED_EXTENSIONS:
            as_is = MEDIA_TYPE_EXTENSIONS.get(self.media_type, ())
            allowed = ", ".join((*as_is, *(suffix for suffix in SUPPORTED_EXTENSIONS if suffix not in as_is)))
            raise ValueError(
                f"path: extension {path.suffix or '(none)'!r} is not allowed for this result; use {allowed}"
            )
        return save_frames(path, self.frames, self.fps)

    def save_audio(self, path: str | Path) -> Path:
        """Writes the sound to `path` as a WAV file (16-bit PCM at `audio_sample_rate`); ValueError without one."""
        import wave

        if self.audio is None:
            raise ValueError(
                "path: this result has no sound to write as .wav (its model makes none, or it was not sent)"
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        channels = self.audio.shape[0]
        pcm = (np.clip(self.audio, -1.0, 1.0) * 32767.0).round().astype("<i2").T
        with wave.open(str(path), "wb") as out:
            out.setnchannels(channels)
            out.setsampwidth(2)
            out.setframerate(self.audio_sample_rate)
            out.writeframes(np.ascontiguousarray(pcm).tobytes())
        return path

    def __repr__(self) -> str:
        held = f"data={len(self.data)} bytes of {self.media_type}" if self.data is not None else "raw frames"
        if self.audio is not None:
            held += f", audio {list(self.audio.shape)} at {self.audio_sample_rate} Hz"
        return (
            f"GenerationResult(job_id={self.job_id!r}, num_frames={self.num_frames}, fps={self.fps}, {held}, "
            f"seed={self.seed})"
        )


Event = Queued | Progress | Paused | Resumed | FramesReceived | BytesReceived | GenerationResult


class ResultBuilder:
    """Turns a job's event stream into typed events and, at the end, a GenerationResult.

    Raw frames arrive as tensor chunks (possibly several per piece of frames); an encoded file as byte
    chunks in order, each at the offset where the previous one ended. A gap, or a size other than the one
    the server reports at the end, raises InternalError (DATA_LOSS).
    """

    def __init__(self) -> None:
        self.assembler = TensorAssembler()
        self.pieces: dict[int, np.ndarray] = {}
        self.fps = 0.0
        self.encoded: list[bytes] = []
        self.encoded_size = 0
        self.media_type = ""
        self.audio: np.ndarray | None = None
        self.audio_sample_rate = 0

    def consume(self, event: generation_pb2.GenerateEvent) -> list[Event]:
        kind = event.WhichOneof("event")
        if kind == "queued":
            return [Queued(event.job_id, event.queued.position)]
        if kind == "progress":
            return [Progress(event.job_id, event.progress.stage, event.progress.step, event.progress.total)]
        if kind == "paused":
            paused = event.paused
            return [Paused(event.job_id, paused.stage, paused.step, paused.total, paused.reason, paused.preemptions)]
        if kind == "resumed":
            return [Resumed(event.job_id, event.resumed.stage, event.resumed.step, event.resumed.total)]
        if kind == "result":
            self.fps = event.result.fps
            events: list[Event] = []
            if event.result.HasField("tensor"):
                tensor = self.assembler.feed(event.result.tensor)
                if tensor is not None and tensor.name == AUDIO_TENSOR:
                    self._add_audio(tensor.array, event.result.audio_sample_rate)
                elif tensor is not None:
                    self.pieces[tensor.index] = tensor.array
                    events.append(FramesReceived(event.job_id, tensor.index, tensor.shape[0]))
            if event.result.HasField("encoded"):
                events.append(self._add_encoded(event.job_id, event.result.encoded))
            return events
        if kind == "completed":
            return [self._finish(event.job_id, event.completed)]
        return []

    def _add_audio(self, waveform: np.ndarray, sample_rate: int) -> None:
        if self.audio is not None:
            raise InternalError(grpc.StatusCode.DATA_LOSS, "audio: the sound arrived twice")
        if waveform.dtype != np.float32 or waveform.ndim != 2 or sample_rate <= 0:
            raise InternalError(
                grpc.StatusCode.DATA_LOSS,
                f"audio: a {waveform.dtype} tensor of shape {list(waveform.shape)} at {sample_rate} Hz is not a "
                "float32 [channels, samples] sound",
            )
        self.audio, self.audio_sample_rate = waveform, sample_rate

    def _add_encoded(self, job_id: str, chunk: generation_pb2.EncodedChunk) -> BytesReceived:
        if chunk.offset != self.encoded_size:
            raise InternalError(
                grpc.StatusCode.DATA_LOSS,
                f"encoded result: a chunk at byte {chunk.offset} arrived after {self.encoded_size} bytes; "
                "the bytes between are missing",
            )
        if self.media_type and chunk.media_type and chunk.media_type != self.media_type:
            raise InternalError(
                grpc.StatusCode.DATA_LOSS,
                f"encoded result: a {chunk.media_type} chunk arrived in a {self.media_type} file",
            )
        self.media_type = self.media_type or chunk.media_type
        self.encoded.append(chunk.data)
        self.encoded_size += len(chunk.data)
        return BytesReceived(job_id, chunk.offset, len(chunk.data))

    def _finish(self, job_id: str, completed: generation_pb2.JobCompleted) -> GenerationResult:
        self.assembler.finish()
        data = b"".join(self.encoded) if self.encoded or completed.encoded_bytes else None
        if data is not None and len(data) != completed.encoded_bytes:
            raise InternalError(
                grpc.StatusCode.DATA_LOSS,
                f"encoded result: received {len(data)} bytes, the server reported {completed.encoded_bytes}",
            )
        video = None
        if self.pieces or data is None:
            frames = [self.pieces[index] for index in sorted(self.pieces)]
            video = np.concatenate(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)
            if video.shape[0] != completed.num_frames:
                raise InternalError(
                    grpc.StatusCode.DATA_LOSS,
                    f"received {video.shape[0]} frames, the server reported {completed.num_frames}",
                )
        return GenerationResult(
            job_id,
            video,
            completed.fps,
            dict(completed.timings),
            passes_run=completed.transformer_passes.run,
            passes_skipped=completed.transformer_passes.skipped,
            data=data,
            media_type=(completed.media_type or self.media_type) if data is not None else "",
            seed=completed.seed,
            num_frames=completed.num_frames,
            notices=[Notice.from_proto(notice) for notice in completed.notices],
            audio=self.audio,
            audio_sample_rate=self.audio_sample_rate,
        )
