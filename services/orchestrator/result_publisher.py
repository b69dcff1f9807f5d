"""Writing a job's final frames into its result file as they arrive, and announcing each whole piece.

Frames go to disk, not to memory. The result's shape is known when the job
starts, so its file is preallocated in the store, and the final stage's frame
chunks are written at their frame offsets as they arrive; each piece, once
whole, is announced in the job's log as a `ResultPiece` that watchers read back
from the file (and handed to the job's encoder for an encoded output_format).
Only these final frames are checked, against the result's shape, as they are
written.

Frames already published are not written or published again on a retry: stages
are deterministic, so the frame index says what a retry may skip, and a piece
cut half-way was never published, so the retry writes it again from its first
byte.

The sound of a model that makes video with sound comes from the VAE as one
tensor "audio", float32 [channels, samples], after its last frames (past the
interpolator, which changes the frame rate, never the video's length):
`publish_audio` checks it against the model's ModelLimits (its channels, and
at most `max_audio_samples` of the request), gathers it (bounded by that
check), writes it whole to the job's sound file, announces it, and hands it to
the encoder. A request that leaves the sound out (audio_codec "none") drops it;
a retried VAE's sound, once published, too.
"""

from __future__ import annotations

import asyncio

import numpy as np

from services.encoding import AudioTrack
from services.metrics import OrchestratorMetrics
from services.orchestrator.admission import has_sound, max_audio_samples
from services.orchestrator.job import Job
from services.orchestrator.store import JobStore, ResultWriter
from stagediff.tensor_codec import WireError
from stagediff.v1 import tensor_pb2


class ResultPublisher:
    """Writes the final stage's frame chunks into the job's result file and announces each whole piece.

    Tensors reach the orchestrator in frame order: everything below
    `frames_published` (in the job's intermediates, so it outlives a retried
    attempt) was written and announced, and a retried stage's tensors that end
    there are skipped. A tensor cut half-way by a failed attempt was never
    announced; the retry writes it again from its first byte. Each chunk is
    checked against the result's shape before it is written: a stage that
    sends frames out of order, of another shape or dtype, or more bytes than
    its header announced fails the job (WireError).
    """

    def __init__(
        self,
        job: Job,
        writer: ResultWriter,
        fps: float,
        metrics: OrchestratorMetrics | None = None,
        *,
        sound: AudioTrack | None = None,
        store: JobStore | None = None,
    ) -> None:
        self.job = job
        self.writer = writer
        self.fps = fps
        self.metrics = metrics
        self.piece: tuple[int, int] | None = None  # (first frame, count) of the tensor being received
        self.skipping = False
        self.received = 0  # bytes of that tensor written so far
        # The model's sound (ModelLimits.audio_sample_rate, audio_channels), None for a model without sound; the
        # store the sound file is written to.
        self.sound = sound
        self.store = store
        self.audio_shape: tuple[int, int] | None = None  # of the sound tensor being received
        self.audio_data = bytearray()
        self.audio_received = False  # this attempt's VAE sent its whole sound

    async def publish(self, chunk: tensor_pb2.TensorChunk) -> None:
        published = self.job.intermediates.get("frames_published", 0)
        if chunk.HasField("header"):
            self.piece = self._check_header(chunk.header, published)
            self.received = 0
            self.skipping = sum(self.piece) <= published
        elif self.piece is None:
            raise WireError("a frame chunk arrived before any tensor header")
        if self.skipping:
            return
        first, count = self.piece
        size = count * self.writer.frame_bytes
        end = self.received + len(chunk.data)
        if chunk.offset != self.received or end > size or chunk.last != (end == size):
            raise WireError(
                f"frames {first}..{first + count - 1}: chunk at byte {chunk.offset} of {len(chunk.data)} bytes "
                f"(last={chunk.last}) does not follow byte {self.received} of {size}"
            )
        await asyncio.to_thread(self.writer.write, first, chunk.offset, chunk.data)
        self.received = end
        if not chunk.last:
            return
        self.writer.add_piece(first, count)
        self.job.intermediates["frames_published"] = first + count
        self.piece = None
        if self.metrics is not None:
            self.metrics.add_frames(self.job.tenant, first + count - published)
        await self.job.publish_piece(first, count, self.fps)
        if self.job.encoder is not None:  # an encoded output_format: each piece is encoded once written
            await self.job.encoder.add(first, count)

    async def publish_audio(self, chunk: tensor_pb2.TensorChunk) -> None:
        """Takes a chunk of the VAE's tensor "audio"; once whole, writes, announces and encodes the sound."""
        if chunk.HasField("header"):
            if self.audio_shape is not None or self.audio_received:
                raise WireError("audio: a second sound tensor arrived; a stage sends one")
            self.audio_shape = self._check_audio_header(chunk.header)
            self.audio_data = bytearray()
        elif self.audio_shape is None:
            raise WireError("audio: a chunk arrived before its tensor header")
        channels, samples = self.audio_shape
        size = channels * samples * 4
        end = len(self.audio_data) + len(chunk.data)
        if chunk.offset != len(self.audio_data) or end > size or chunk.last != (end == size):
            raise WireError(
                f"audio: chunk at byte {chunk.offset} of {len(chunk.data)} bytes (last={chunk.last}) does not "
                f"follow byte {len(self.audio_data)} of {size}"
            )
        self.audio_data += chunk.data
        if not chunk.last:
            return
        data, self.audio_data, self.audio_shape = bytes(self.audio_data), bytearray(), None
        self.audio_received = True
        job = self.job
        if not has_sound(job.request) or job.intermediates.get("audio_published"):
            return  # the request leaves the sound out, or a retried VAE sent it again
        assert self.sound is not None  # a header is refused for a model without sound
        waveform = np.frombuffer(data, "<f4").reshape(channels, samples)
        if not np.isfinite(waveform).all():
            raise WireError("audio: the sound holds NaN or infinite samples")
        if self.store is None:
            raise RuntimeError("ResultPublisher needs a JobStore to write the sound into")
        job.audio = await asyncio.to_thread(self.store.create_audio, job.job_id, waveform, self.sound.sample_rate)
        job.intermediates["audio_published"] = True
        await job.publish_audio(self.sound.sample_rate)
        if job.encoder is not None:
            await job.encoder.add_audio(waveform)

    def _check_audio_header(self, header: tensor_pb2.TensorHeader) -> tuple[int, int]:
        """(channels, samples) of a sound tensor that fits the model and the request; raises WireError otherwise."""
        model = self.job.request.model
        if self.sound is None:
            raise WireError(f"audio: a sound tensor arrived for model '{model}', which makes no sound")
        shape = list(header.shape)
        bound = max_audio_samples(self.job.request, self.sound.sample_rate)
        if (
            header.datatype != "FP32"
            or len(shape) != 2
            or shape[0] != self.sound.channels
            or not 1 <= shape[1] <= bound
            or header.index != 0
        ):
            raise WireError(
                f"audio: a {header.datatype} tensor of shape {shape} (index {header.index}) does not fit the sound "
                f"of model '{model}', float32 [{self.sound.channels}, 1..{bound}] at index 0"
            )
        return shape[0], shape[1]

    def _check_header(self, header: tensor_pb2.TensorHeader, published: int) -> tuple[int, int]:
        """(first frame, count) of a frame tensor that fits the result; raises WireError otherwise."""
        total, height, width, channels = self.writer.shape
        shape = list(header.shape)
        count = shape[0] if shape else 0
        first = header.index
        if header.datatype != "UINT8" or shape[1:] != [height, width, channels] or count < 1:
            raise WireError(
                f"frames: a {header.datatype} tensor of shape {shape} does not fit the result, "
                f"uint8 [F, {height}, {width}, {channels}]"
            )
        if first < 0 or first + count > total:
            raise WireError(f"frames {first}..{first + count - 1}: the result has {total} frames")
        if first + count > published and first != published:
            raise WireError(f"frames {first}..{first + count - 1}: frame {published} was expected next")
        return first, count
