"""Structural limits on a client's image file, checked before Pillow parses a byte of it.

Pillow reads a file's header one segment or chunk at a time in Python, and libjpeg decodes a progressive
JPEG one scan at a time over the whole image: a small file built of many tiny pieces costs seconds of CPU
while passing every size check (thousands of 36-byte scans; millions of 4-byte COM segments or 12-byte PNG
chunks). `check_structure` walks the file's container at C speed (slicing, `bytes.find`, a regular
expression over entropy-coded data) and refuses, naming the field and the limit, a file with more than
`Limits.jpeg_scans` scans, more than `Limits.header_bytes` before its pixel data (the first SOS, IDAT or
VP8/VP8L), or more than `Limits.segments` segments or chunks. Legitimate files sit far below each limit:
a progressive JPEG has about 10 scans (libjpeg's default script), and a phone photo's EXIF, XMP, ICC and
MPF segments fit in well under the header limit.

In a JPEG's entropy-coded data every 0xFF byte is followed by 0x00 (stuffing) or a restart marker
(0xD0-0xD7), so the next other marker is found exactly. A file this walk cannot follow (truncated, a bad
length) is left to Pillow, which refuses it by its own reading; only the first picture of a JPEG is walked,
as only it is decoded. No torch and no Pillow here.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from stagekit.errors import RequestError


@dataclass(frozen=True)
class Limits:
    jpeg_scans: int = 32  # SOS markers in a JPEG's first picture
    header_bytes: int = 256 << 10  # bytes before the first SOS (JPEG), IDAT (PNG) or VP8/VP8L chunk (WebP)
    segments: int = 256  # JPEG marker segments, or WebP chunks; PNG chunks other than IDAT
    png_chunks: int = 4096  # every PNG chunk, IDAT included (encoders write IDATs of 8 KiB or more)


DEFAULT_LIMITS = Limits()

_JPEG_SOI = b"\xff\xd8"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A marker after entropy-coded data: 0xFF followed by neither a stuffed 0x00, a restart marker nor a fill byte.
_ENTROPY_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOS, _EOI = 0xDA, 0xD9
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM and RSTn carry no length


def check_structure(data: bytes, field: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raises RequestError when the JPEG, PNG or WebP file `data` breaks one of `limits`; other bytes pass
    through untouched (the caller's reader refuses what it cannot identify)."""
    if data.startswith(_JPEG_SOI):
        _check_jpeg(data, field, limits)
    elif data.startswith(_PNG_SIGNATURE):
        _check_png(data, field, limits)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        _check_webp(data, field, limits)


def _refuse(field: str, fmt: str, excess: str) -> RequestError:
    """The refusal of a `fmt` file with more than the limit `excess` names (e.g. "32 scans")."""
    return RequestError(
        f"{field}: the {fmt} file has more than {excess}, the most allowed; re-encode the image "
        "(e.g. save it again as a baseline JPEG or a plain PNG)"
    )


def _check_jpeg(data: bytes, field: str, limits: Limits) -> None:
    position, segments, scans = 2, 0, 0
    while position + 4 <= len(data):
        while position + 1 < len(data) and data[position + 1] == 0xFF:  # fill bytes before a marker
            position += 1
        if position + 4 > len(data):
            return  # fill bytes ran up to the end: no room for a marker and its length, Pillow refuses the file
        if data[position] != 0xFF:
            return  # not a marker where one must be: Pillow refuses the file
        marker = data[position + 1]
        if marker in _STANDALONE:
            position += 2
            continue
        if marker == _EOI:
            return
        if scans == 0 and position > limits.header_bytes:
            raise _refuse(field, "JPEG", f"{limits.header_bytes} bytes before its image data")
        segments += 1
        if segments > limits.segments:
            raise _refuse(field, "JPEG", f"{limits.segments} marker segments")
        (length,) = struct.unpack_from(">H", data, position + 2)
        end = position + 2 + length
        if length < 2 or end > len(data):
            return
        if marker != _SOS:
            position = end
            continue
        scans += 1
        if scans > limits.jpeg_scans:
            raise _refuse(field, "JPEG", f"{limits.jpeg_scans} scans")
        found = _ENTROPY_END.search(data, end)
        if found is None:
            return
        position = found.start()


def _check_png(data: bytes, field: str, limits: Limits) -> None:
    position, chunks, others, seen_image = 8, 0, 0, False
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        if kind == b"IDAT":
            if not seen_image and position > limits.header_bytes:
                raise _refuse(field, "PNG", f"{limits.header_bytes} bytes before its image data")
            seen_image = True
        else:
            others += 1
            if others > limits.segments:
                raise _refuse(field, "PNG", f"{limits.segments} chunks besides IDAT")
        chunks += 1
        if chunks > limits.png_chunks:
            raise _refuse(field, "PNG", f"{limits.png_chunks} chunks")
        if kind == b"IEND":
            return
        position += 12 + length  # length, type, data, CRC
    if not seen_image and position > limits.header_bytes:
        raise _refuse(field, "PNG", f"{limits.header_bytes} bytes before its image data")


def _check_webp(data: bytes, field: str, limits: Limits) -> None:
    position, chunks = 12, 0
    while position + 8 <= len(data):
        kind, length = struct.unpack_from("<4sI", data, position)
        chunks += 1
        if chunks > limits.segments:
            raise _refuse(field, "WebP", f"{limits.segments} chunks")
        if kind in (b"VP8 ", b"VP8L"):
            if position > limits.header_bytes:
                raise _refuse(field, "WebP", f"{limits.header_bytes} bytes before its image data")
            return
        position += 8 + length + (length & 1)  # chunks are padded to an even size
