"""Image files built to cost a server CPU and memory while passing every size check: what bench/hostile.py
sends and what the tests of services/image_structure.py refuse.

- `scan_bomb_jpeg`: a progressive JPEG whose last scan is repeated `scans` times. libjpeg takes each
  repetition as one more scan over every block of the image (a bogus progression is only a warning).
- `comment_stuffed_jpeg`: a small JPEG with `segments` empty COM segments (4 bytes each) after its SOI,
  each one a turn of Pillow's Python header loop.
- `chunk_stuffed_png`: a small PNG with `chunks` empty ancillary chunks (12 bytes each) before its IDAT.
- `padded_png`: a tiny PNG followed by `pad_bytes` of zeros after its IEND, which every reader ignores:
  an image that is small to decode and large to hold.
"""

from __future__ import annotations

import struct
import zlib
from io import BytesIO

from PIL import Image

_EOI = b"\xff\xd9"


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def scan_bomb_jpeg(side: int = 4096, scans: int = 3000) -> bytes:
    """A side x side flat grey progressive JPEG whose last scan (SOS header and data) is sent `scans` times."""
    data = _encoded(Image.new("L", (side, side), 128), "JPEG", progressive=True, quality=10)
    last_scan = data.rindex(b"\xff\xda")
    end = data.rindex(_EOI)
    return data[:end] + data[last_scan:end] * (scans - 1) + _EOI


def comment_stuffed_jpeg(segments: int = 100_000, side: int = 64) -> bytes:
    data = _encoded(Image.new("RGB", (side, side), (200, 30, 30)), "JPEG", quality=90)
    return data[:2] + b"\xff\xfe\x00\x02" * segments + data[2:]


def _chunk(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def chunk_stuffed_png(chunks: int = 100_000, side: int = 64) -> bytes:
    data = _encoded(Image.new("RGB", (side, side), (30, 200, 30)), "PNG")
    first_idat = data.index(b"IDAT") - 4
    return data[:first_idat] + _chunk(b"teXt") * chunks + data[first_idat:]


def padded_png(pad_bytes: int, side: int = 64) -> bytes:
    return _encoded(Image.new("RGB", (side, side), (30, 30, 200)), "PNG") + bytes(pad_bytes)
