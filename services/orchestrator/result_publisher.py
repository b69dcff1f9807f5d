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
"""

from __future__ import annotations

import asyncio

from services.metrics import OrchestratorMetrics
from services.orchestrator.job import Job
from services.orchestrator.store import ResultWriter
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
    ) -> None:
        self.job = job
        self.writer = writer
        self.fps = fps
        self.metrics = metrics
        self.piece: tuple[int, int] | None = None  # (first frame, count) of the tensor being received
        self.skipping = False
        self.received = 0  # bytes of that tensor written so far

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
