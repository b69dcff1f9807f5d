"""Clients' image files that cost CPU while passing every size check are refused before Pillow parses them,
and the decodes that do run stop when their caller gives up or their deadline passes, without a lock."""

from __future__ import annotations

import asyncio
import re
import struct
import threading
import time
from io import BytesIO

import numpy as np
import pytest
from PIL import Image

from bench.hostile_files import chunk_stuffed_png, comment_stuffed_jpeg, padded_png, scan_bomb_jpeg
from services.image_structure import DEFAULT_LIMITS, check_structure
from services.image_work import ImageWorkers
from services.images import DecodeCancelled, Stop, decode_image, probe_image
from stagekit.errors import RequestError

FIELD = "images[0].data"


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(side: int = 256) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))


def refusal(data: bytes) -> str:
    """The message of the refusal of `data`, by the header probe (which runs the structural check first)."""
    started = time.monotonic()
    with pytest.raises(RequestError) as caught:
        probe_image(data, FIELD)
    assert time.monotonic() - started < 2.0  # refused at the door, not after a decode of many seconds
    message = str(caught.value)
    assert message.startswith(f"{FIELD}: ") and "re-encode the image" in message
    return message


def test_a_scan_bomb_jpeg_is_refused_by_its_scan_count() -> None:
    assert "32 scans" in refusal(scan_bomb_jpeg(4096, 3000))


def test_a_jpeg_of_comment_segments_is_refused_by_its_segment_count() -> None:
    assert "256 marker segments" in refusal(comment_stuffed_jpeg(100_000))


def test_a_png_of_ancillary_chunks_is_refused_by_its_chunk_count() -> None:
    assert "256 chunks besides IDAT" in refusal(chunk_stuffed_png(100_000))


def test_a_png_of_tiny_idat_chunks_is_refused() -> None:
    data = encoded(noise(128), "PNG")
    signature_and_header = data[: data.index(b"IDAT") - 4]
    pixels = zlib_stream(data)
    idats = b"".join(png_chunk(b"IDAT", pixels[i : i + 1]) for i in range(len(pixels)))
    assert "4096 chunks" in refusal(signature_and_header + idats + png_chunk(b"IEND"))


@pytest.mark.parametrize("fill", [1, 4, 5])
def test_fill_bytes_up_to_the_end_of_a_jpeg_are_left_to_pillow(fill: int) -> None:
    """Fill bytes (0xFF) that run to the file's last byte or two leave no room for a segment's length: the walk
    stops there, and the decoder refuses the file naming the field (not a struct.error)."""
    for tail in (b"", b"\xc0", b"\xc0\x00"):
        data = b"\xff\xd8" + b"\xff" * fill + tail
        check_structure(data, FIELD)
        with pytest.raises(RequestError, match=f"^{re.escape(FIELD)}: "):
            decode_image(data, FIELD)


def test_a_jpeg_with_too_many_header_bytes_is_refused() -> None:
    data = encoded(noise(64), "JPEG")
    app = b"\xff\xe9" + struct.pack(">H", 65535) + bytes(65533)  # APP9, the largest segment there is
    assert "262144 bytes before its image data" in refusal(data[:2] + app * 5 + data[2:])


def test_a_png_with_too_many_header_bytes_is_refused() -> None:
    data = encoded(noise(64), "PNG")
    first_idat = data.index(b"IDAT") - 4
    big = png_chunk(b"zzZz", bytes(300 << 10))
    assert "262144 bytes before its image data" in refusal(data[:first_idat] + big + data[first_idat:])


def test_a_webp_of_many_chunks_is_refused() -> None:
    data = encoded(noise(64), "WEBP")
    chunks = b"ZZZZ" + struct.pack("<I", 0)
    body = data[12:]
    stuffed = chunks * 1000 + body
    riff = b"RIFF" + struct.pack("<I", 4 + len(stuffed)) + b"WEBP" + stuffed
    assert "256 chunks" in refusal(riff)


@pytest.mark.parametrize(
    "fmt, options",
    [
        ("JPEG", {"progressive": True}),
        ("JPEG", {"quality": 95, "subsampling": 0}),
        ("PNG", {}),
        ("WEBP", {"quality": 80}),
        ("WEBP", {"lossless": True}),
    ],
)
def test_ordinary_files_pass_well_inside_the_limits(fmt: str, options: dict) -> None:
    image = noise(512)
    exif = Image.Exif()
    exif[0x0112] = 1
    data = encoded(image, fmt, exif=exif.tobytes(), icc_profile=bytes(3000), **options)
    check_structure(data, FIELD)
    assert decode_image(data, FIELD).size == (512, 512)
    if fmt == "JPEG":
        assert data.count(b"\xff\xda") <= DEFAULT_LIMITS.jpeg_scans // 3


def test_a_jpeg_of_several_pictures_counts_the_scans_of_its_first() -> None:
    # An MPO (a phone's gain map, a stereo pair) holds one JPEG after another: only the first is decoded.
    pictures = [noise(64)] * 5
    data = encoded(pictures[0], "MPO", save_all=True, append_images=pictures[1:], progressive=True)
    assert data.count(b"\xff\xda") > DEFAULT_LIMITS.jpeg_scans
    check_structure(data, FIELD)


def test_bytes_after_the_end_of_a_png_pass_the_walk() -> None:
    check_structure(padded_png(1 << 20), FIELD)


def test_a_cancelled_stop_ends_a_decode_at_its_next_read() -> None:
    stop = Stop()
    stop.cancel()
    with pytest.raises(DecodeCancelled):
        decode_image(encoded(noise(), "PNG"), FIELD, stop=stop)


def test_a_decode_past_its_deadline_is_refused_naming_the_field() -> None:
    stop = Stop(deadline_s=0.001)
    stop.start()
    time.sleep(0.01)
    with pytest.raises(RequestError, match=rf"^{FIELD.replace('[', '.').replace(']', '.')}: decoding the image took"):
        decode_image(encoded(noise(), "JPEG"), FIELD, stop=stop)


class PausingStop(Stop):
    """Pauses the decode it watches at its first read of pixel data, until released."""

    def __init__(self) -> None:
        super().__init__()
        self.paused, self.release, self.reads = threading.Event(), threading.Event(), 0

    def check(self, field: str) -> None:
        self.reads += 1
        if threading.current_thread().name == "decoder" and self.reads > 3:
            self.paused.set()
            self.release.wait(30)
        super().check(field)


def test_a_decode_in_progress_holds_no_lock_against_other_images() -> None:
    stop = PausingStop()
    decoder = threading.Thread(
        target=decode_image, args=(encoded(noise(1024), "JPEG"), FIELD), kwargs={"stop": stop}, name="decoder"
    )
    decoder.start()
    try:
        assert stop.paused.wait(30)
        prober = threading.Thread(target=probe_image, args=(encoded(noise(64), "PNG"), FIELD))
        prober.start()
        prober.join(10)
        assert not prober.is_alive(), "a probe waited for another image's decode"
        decode_image(encoded(noise(64), "WEBP"), FIELD)
    finally:
        stop.release.set()
        decoder.join(30)


def test_image_workers_run_off_the_loop_and_stop_work_whose_caller_is_cancelled() -> None:
    workers = ImageWorkers(threads=1, deadline_s=30)
    ended: list[str] = []

    def spin(stop: Stop) -> str:
        while True:
            try:
                stop.check(FIELD)
            except DecodeCancelled:
                ended.append(threading.current_thread().name)
                raise
            time.sleep(0.005)

    async def main() -> None:
        task = asyncio.create_task(workers.run(spin))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker is free again: the next piece of work runs.
        assert await asyncio.wait_for(workers.run(lambda stop: "next"), 10) == "next"

    try:
        asyncio.run(main())
    finally:
        workers.close()
    assert ended and ended[0].startswith("images")


def test_image_workers_refuse_work_past_its_deadline() -> None:
    workers = ImageWorkers(threads=1, deadline_s=0.05)

    def slow(stop: Stop) -> None:
        while True:
            stop.check(FIELD)
            time.sleep(0.01)

    try:
        with pytest.raises(RequestError, match="took more than 0.05 s"):
            asyncio.run(workers.run(slow))
    finally:
        workers.close()


def png_chunk(kind: bytes, payload: bytes = b"") -> bytes:
    import zlib

    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def zlib_stream(png: bytes) -> bytes:
    """The concatenated IDAT payloads of `png`."""
    position, stream = 8, b""
    while position < len(png):
        length, kind = struct.unpack_from(">I4s", png, position)
        if kind == b"IDAT":
            stream += png[position + 8 : position + 8 + length]
        position += 12 + length
    return stream
