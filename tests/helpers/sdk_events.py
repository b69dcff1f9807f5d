"""A job's events carrying an encoded file (PNG), as the SDK receives them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2

IMAGE = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(1, 8, 8, 3)


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(IMAGE[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def encoded_events(data: bytes, media_type: str, pieces: int = 3, raw: np.ndarray | None = None, **completed):
    """A job's events: the file in `pieces` chunks (and raw frames too when given), then JobCompleted."""
    events = [generation_pb2.GenerateEvent(job_id="j", queued=generation_pb2.JobQueued(position=0))]
    if raw is not None:
        for chunk in encode_tensor("frames", raw, index=0):
            events.append(
                generation_pb2.GenerateEvent(job_id="j", result=generation_pb2.ResultChunk(tensor=chunk, fps=8))
            )
    size = -(-len(data) // pieces)
    for offset in range(0, len(data), size):
        chunk = generation_pb2.EncodedChunk(
            media_type=media_type, offset=offset, data=data[offset : offset + size], last=offset + size >= len(data)
        )
        events.append(generation_pb2.GenerateEvent(job_id="j", result=generation_pb2.ResultChunk(encoded=chunk, fps=8)))
    fields = {"num_frames": 1, "fps": 8, "media_type": media_type, "encoded_bytes": len(data), "seed": 42}
    events.append(generation_pb2.GenerateEvent(job_id="j", completed=generation_pb2.JobCompleted(**fields | completed)))
    return events
