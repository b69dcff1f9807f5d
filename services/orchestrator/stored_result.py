"""`StoredResult`: a finished job's result as the store describes it (store/results.py makes it from its row).

Its files are local paths, or keys in a blob store; it opens them through the readers of result_files.py, one
at a time, and replays them as the events a watcher of the live job received. A file deleted since (a pruned
job) raises ResultGone when it is opened.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.orchestrator.blobs.protocol import BlobStore
from services.orchestrator.result_files import AudioReader, EncodedReader, ResultReader
from services.orchestrator.result_sources import BlobSource
from services.orchestrator.store_errors import ResultGone, io_error
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, stages_pb2


@dataclass
class StoredResult:
    """A finished job's result: its raw frames' file (unless an encoded result did not keep them), its
    encoded file (when the request asked for a format), the frames' shape, and how they were first published.

    The files are local paths, or, with a blob store, the keys `raw_key` and `encoded_key` in `blobs`.
    """

    path: Path | None  # the raw frames (.npy); None when only the encoded file was kept (or with a blob store)
    shape: tuple[int, int, int, int]
    data_offset: int
    fps: float
    pieces: list[tuple[int, int]]  # (first frame, count) of each published tensor, in order
    timings: dict[str, float]
    transformer_passes: tuple[int, int] = (0, 0)  # (run, skipped) by the DiT
    notices: list[stages_pb2.Notice] = field(default_factory=list)  # the job's (services/orchestrator/notices.py)
    media_type: str = ""  # of the encoded file; "" for a raw result
    encoded_path: Path | None = None
    encoded_bytes: int = 0
    blobs: BlobStore | None = None
    raw_key: str | None = None
    encoded_key: str | None = None
    # The sound of a result with sound, kept with its raw frames: a local file or a blob, its shape
    # [channels, samples] and samples per second.
    audio_path: Path | None = None
    audio_key: str | None = None
    audio_shape: tuple[int, int] = (0, 0)
    audio_rate: int = 0
    audio_offset: int = 0

    @property
    def num_frames(self) -> int:
        return int(self.shape[0])

    @property
    def has_raw(self) -> bool:
        return self.path is not None or self.raw_key is not None

    @property
    def has_encoded(self) -> bool:
        return self.encoded_path is not None or self.encoded_key is not None

    @property
    def frames(self) -> np.ndarray:
        """Every frame (memory-mapped read-only when local): for tools and tests; serving reads with `open`."""
        if self.path is not None:
            return np.load(self.path, mmap_mode="r", allow_pickle=False)
        with self.open() as reader:
            return reader.frames(0, self.num_frames)

    def open(self) -> ResultReader:
        """A reader of this result's raw frames; raises ResultGone if they were deleted since (or not kept)."""
        if self.path is not None:
            return ResultReader(_open_read(self.path), self.shape, self.data_offset)
        if self.blobs is not None and self.raw_key is not None:
            return ResultReader(BlobSource(self.blobs, self.raw_key), self.shape, self.data_offset)
        raise ResultGone("the result kept only its encoded file")

    @property
    def has_audio(self) -> bool:
        return self.audio_path is not None or self.audio_key is not None

    @property
    def audio_bytes(self) -> int:
        return self.audio_offset + self.audio_shape[0] * self.audio_shape[1] * 4 if self.has_audio else 0

    def open_audio(self) -> AudioReader:
        """A reader of this result's sound; raises ResultGone if it has none or it was deleted since."""
        if self.audio_path is not None:
            return AudioReader(_open_read(self.audio_path), self.audio_shape, self.audio_offset)
        if self.blobs is not None and self.audio_key is not None:
            return AudioReader(BlobSource(self.blobs, self.audio_key), self.audio_shape, self.audio_offset)
        raise ResultGone("the result has no sound")

    @property
    def audio(self) -> np.ndarray | None:
        """The sound, float32 [channels, samples], None for a silent result: for tools and tests."""
        if not self.has_audio:
            return None
        with self.open_audio() as reader:
            return reader.waveform()

    def open_encoded(self) -> EncodedReader:
        """A reader of this result's encoded file; raises ResultGone if it was deleted since."""
        if self.encoded_path is not None:
            return EncodedReader(_open_read(self.encoded_path), self.media_type)
        if self.blobs is not None and self.encoded_key is not None:
            return EncodedReader(BlobSource(self.blobs, self.encoded_key), self.media_type)
        raise ResultGone("the result has no encoded file")

    def completed_event(self, job_id: str = "", seed: int = 0) -> generation_pb2.GenerateEvent:
        return generation_pb2.GenerateEvent(
            job_id=job_id,
            completed=generation_pb2.JobCompleted(
                timings=self.timings,
                num_frames=self.num_frames,
                fps=self.fps,
                transformer_passes=stages_pb2.TransformerPasses(
                    run=self.transformer_passes[0], skipped=self.transformer_passes[1]
                ),
                media_type=self.media_type,
                encoded_bytes=self.encoded_bytes,
                seed=seed,
                notices=self.notices,
            ),
        )

    def events(
        self, job_id: str = "", *, seed: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Generator[generation_pb2.GenerateEvent]:
        """The result chunks and the completion event, as a watcher of the live job received them: the raw
        frames (when kept) and their sound (when there is one), then the encoded file (when there is one).

        Read from the files one chunk at a time (blocking; a file is opened at the first `next` that needs it).
        """
        if self.has_raw:
            with self.open() as reader:
                for first, count in self.pieces:
                    for chunk in reader.chunks(first, count, chunk_bytes=chunk_bytes):
                        yield generation_pb2.GenerateEvent(
                            job_id=job_id, result=generation_pb2.ResultChunk(tensor=chunk, fps=self.fps)
                        )
        if self.has_audio:
            with self.open_audio() as audio:
                for chunk in audio.chunks(chunk_bytes=chunk_bytes):
                    yield generation_pb2.GenerateEvent(
                        job_id=job_id,
                        result=generation_pb2.ResultChunk(
                            tensor=chunk, fps=self.fps, audio_sample_rate=self.audio_rate
                        ),
                    )
        if self.has_encoded:
            with self.open_encoded() as reader:
                for piece in reader.chunks(0, self.encoded_bytes, last=True, chunk_bytes=chunk_bytes):
                    yield generation_pb2.GenerateEvent(
                        job_id=job_id, result=generation_pb2.ResultChunk(encoded=piece, fps=self.fps)
                    )
        yield self.completed_event(job_id, seed)


def _open_read(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ResultGone(f"{path}: the result was deleted") from None
    except OSError as error:
        raise io_error(error, "opening a result file") from None
