"""What the image-conditioned end-to-end tests share: encoded input images, the frame tolerance and the
parallel layouts they run."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encoded(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def assert_close(frames: np.ndarray, expected: np.ndarray) -> None:
    assert frames.dtype == np.uint8 and frames.shape == expected.shape, (frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, f"max difference {difference.max()} levels"
    assert expected.std() > 1.0, "the reference is flat: the comparison would prove little"


# Ulysses and CFG-parallel run in every family's test, HSDP (sharded over the Ulysses ranks) and tensor
# parallelism here; the VAE decodes in bands over two ranks and encodes on its rank 0.
PATCH_PARALLEL_VAE = ["--vae-patch-parallel-size", "2"]


# 4 DiT ranks, the weights sharded over two of them and replicated over the other two.
ULYSSES_CFG_HSDP = [
    *("--ulysses-degree", "2", "--cfg-parallel-size", "2"),
    *("--use-hsdp", "--hsdp-shard-size", "2", "--hsdp-replicate-size", "2"),
]
