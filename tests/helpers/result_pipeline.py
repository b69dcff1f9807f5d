"""The orchestrator's Pipeline with its stage calls replaced by frames made from their index and the seed,
with the requests, expected frames and result assembly the result-path tests use."""

from __future__ import annotations

import numpy as np

from services.orchestrator.pipeline import Pipeline
from services.orchestrator.result_publisher import ResultPublisher
from services.orchestrator.store import JobStore
from services.orchestrator.tenants import Tenant
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2

ACME = Tenant(name="acme")


def make_request(
    num_frames: int, height: int = 16, width: int = 32, *, seed: int = 0, request_id: str = ""
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="fake",
        prompt="a fox",
        height=height,
        width=width,
        num_frames=num_frames,
        seed=seed,
        fps=16.0,
        request_id=request_id,
    )


def expected_frames(request: generation_pb2.GenerateRequest, first: int = 0, count: int | None = None) -> np.ndarray:
    """The frames FramePipeline makes for `request`: each frame filled from its index and the seed."""
    count = request.num_frames - first if count is None else count
    frames = np.empty((count, request.height, request.width, 3), np.uint8)
    for i in range(count):
        frames[i] = (request.seed * 7 + first + i) % 256
        frames[i, 0, 0] = [(first + i) % 256, (first + i) // 256, request.seed % 256]
    return frames


def vae_pieces(num_frames: int) -> list[tuple[int, int]]:
    """(first, count) of the tensors a Wan VAE sends: one frame, then four per latent frame."""
    pieces, first = [], 0
    while first < num_frames:
        count = 1 if first == 0 else min(4, num_frames - first)
        pieces.append((first, count))
        first += count
    return pieces


class FramePipeline(Pipeline):
    """The orchestrator's Pipeline with its stage calls replaced by frames made here.

    `before_piece(job, first)` runs before each piece is published (a test may block or fail there).
    """

    def __init__(self, store: JobStore, before_piece=None) -> None:
        super().__init__(stages=None, store=store, retry_backoff_s=0.0)
        self.before_piece = before_piece

    async def _run_once(self, job) -> None:
        request = job.request
        job.fps_out = request.fps
        publisher = ResultPublisher(job, job.result, job.fps_out, self.metrics)
        for first, count in vae_pieces(request.num_frames):
            if self.before_piece is not None:
                await self.before_piece(job, first)
            for chunk in encode_tensor("frames", expected_frames(request, first, count), index=first):
                await publisher.publish(chunk)


def assemble(events) -> tuple[np.ndarray, list[tuple[int, int]]]:
    assembler = TensorAssembler()
    arrays, pieces = [], []
    for event in events:
        if event.HasField("result"):
            tensor = assembler.feed(event.result.tensor)
            if tensor is not None:
                arrays.append(tensor.array)
                pieces.append((tensor.index, tensor.array.shape[0]))
    assembler.finish()
    return np.concatenate(arrays), pieces
