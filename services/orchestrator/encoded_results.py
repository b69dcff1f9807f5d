"""A job's encoded result, made while its frames arrive: each published piece of frames is fed to the job's
`ResultEncoder` (encoding.py), and whatever the encoder writes is appended to the job's encoded file and
announced to its followers (`Job.publish_encoded`), so that a client receives the start of an MP4 while the
stages still make its end. A result with sound has its waveform muxed in (`add_audio`: AAC in mp4, Opus in webm)
when the VAE sends it, after its frames or, past an interpolator, between them. Encoding runs off the event
loop (PyAV releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import av
import numpy as np

from services.encoding import AudioTrack, ResultEncoder, output_format
from services.orchestrator.job import Job
from services.orchestrator.store import EncodedWriter, ResultReader, ResultWriter

T = TypeVar("T")


class EncodingError(Exception):
    """The encoder failed (a job fails with INTERNAL naming the format)."""


class EncodedResult:
    """Encodes one job's frames into its encoded file, piece by piece, in frame order.

    Lives for one run of the job (its stage retries included, which publish each frame once); `close`
    abandons it when the run fails, `finish` completes the file before the store commits it.
    """

    def __init__(self, job: Job, frames: ResultWriter, file: EncodedWriter) -> None:
        request = job.request
        self.job = job
        self.file = file
        self._frames = frames
        self._reader: ResultReader | None = None
        self.output = output_format(request.output_format)
        self.quality = request.output_quality if request.HasField("output_quality") else None
        # Made with the first frames or the sound, once the pipeline knows the output frame rate (interpolation
        # raises it) and the model's sound (`sound`, set by the pipeline for a result with sound).
        self.encoder: ResultEncoder | None = None
        self.sound: AudioTrack | None = None

    def _encoder(self) -> ResultEncoder:
        if self.encoder is None:
            request = self.job.request
            try:
                self.encoder = ResultEncoder(
                    self.output, self.quality, request.height, request.width, self.job.fps_out, audio=self.sound
                )
            except (ValueError, av.FFmpegError) as error:
                raise EncodingError(f"encoding the result as {self.output.name}: {error}") from None
        return self.encoder

    async def add(self, first: int, count: int) -> None:
        """Encodes frames [first, first + count), just written to the job's result file."""
        encoder = self._encoder()
        if self._reader is None:
            self._reader = await asyncio.to_thread(self._frames.open_reader)
        frames = await asyncio.to_thread(self._reader.frames, first, count)
        await self._append(await self._encode(encoder.add, frames), last=False)

    async def add_audio(self, waveform: np.ndarray) -> None:
        """Encodes the result's whole sound, float32 [channels, samples] (AAC in mp4, Opus in webm)."""
        encoder = self._encoder()
        await self._append(await self._encode(encoder.add_audio, waveform), last=False)

    async def finish(self) -> None:
        """Flushes the encoder: the file's last bytes, announced as its end."""
        if self.encoder is None:
            raise EncodingError(f"encoding the result as {self.output.name}: no frames arrived")
        await self._append(await self._encode(self.encoder.finish), last=True)
        self._close_reader()

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
        self._close_reader()

    async def _encode(self, step: Callable[..., T], *arguments: object) -> T:
        try:
            return await asyncio.to_thread(step, *arguments)
        except (ValueError, av.FFmpegError) as error:
            raise EncodingError(f"encoding the result as {self.output.name}: {error}") from None

    async def _append(self, data: bytes, *, last: bool) -> None:
        if not data and not last:
            return
        offset = await asyncio.to_thread(self.file.append, data) if data else self.file.size
        await self.job.publish_encoded(offset, len(data), last)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
