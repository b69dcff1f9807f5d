"""Input images: every bad file is refused naming the field, and decoding matches diffusers' load_image exactly."""

from __future__ import annotations

import hashlib
import struct
import time
import warnings
import zlib
from io import BytesIO

import numpy as np
import pytest
from diffusers.utils import load_image
from PIL import Image

from services.images import (
    ALLOWED_FORMATS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    ImageInfo,
    decode_image,
    probe_image,
)
from stagekit.errors import RequestError

FIELD = "images[0].data"
ALLOWED_TEXT = "PNG, JPEG or WEBP"
WIDTH, HEIGHT = 37, 23


def pixels(channels: int, seed: int = 0, dtype=np.uint8, high: int = 256) -> np.ndarray:
    """Varied values, a different one at almost every pixel."""
    shape = (HEIGHT, WIDTH) if channels == 1 else (HEIGHT, WIDTH, channels)
    return np.random.default_rng(seed).integers(0, high, size=shape, dtype=dtype)


def rgb_image(seed: int = 0) -> Image.Image:
    return Image.fromarray(pixels(3, seed), "RGB")


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def raw_png(samples: np.ndarray, bit_depth: int, color_type: int) -> bytes:
    """A PNG written by hand, for sample layouts Pillow cannot save (16-bit RGB, RGBA, gray+alpha)."""
    height, width = samples.shape[:2]
    big_endian = samples.astype(">u2" if bit_depth == 16 else np.uint8)
    rows = b"".join(b"\x00" + big_endian[y].tobytes() for y in range(height))  # filter 0 (none) on every row
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )


def png_declaring(width: int, height: int) -> bytes:
    """A valid small PNG whose IHDR is patched to declare width x height (CRC fixed): a decompression bomb."""
    data = bytearray(encode(rgb_image(), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def refusal(data: bytes, function=decode_image, **options) -> str:
    with pytest.raises(RequestError) as caught:
        function(data, FIELD, **options)
    message = str(caught.value)
    assert message.startswith(f"{FIELD}: "), message
    return message


def reference(data: bytes) -> np.ndarray:
    return np.asarray(load_image(Image.open(BytesIO(data))))


def assert_decodes_like_load_image(data: bytes) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_image warns about some palette images; decode_image never does
        expected = reference(data)
    decoded = decode_image(data, FIELD)
    assert decoded.mode == "RGB"
    got = np.asarray(decoded)
    assert got.dtype == np.uint8 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    return got


def test_constants() -> None:
    assert ALLOWED_FORMATS == ("PNG", "JPEG", "WEBP")
    assert MAX_IMAGE_PIXELS == 4096 * 4096
    assert MAX_IMAGE_BYTES == 16 << 20


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_probe_reports_format_size_and_sha256(fmt: str) -> None:
    data = encode(rgb_image(), fmt)
    info = probe_image(data, FIELD)
    assert info == ImageInfo(format=fmt, width=WIDTH, height=HEIGHT, sha256=hashlib.sha256(data).hexdigest())


def test_probe_reports_the_stored_size_of_a_rotated_jpeg() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    info = probe_image(encode(rgb_image(), "JPEG", exif=exif), FIELD)
    assert (info.width, info.height) == (WIDTH, HEIGHT)


def test_probe_accepts_an_image_at_the_pixel_limit() -> None:
    data = encode(rgb_image(), "PNG")
    assert probe_image(data, FIELD, max_pixels=WIDTH * HEIGHT).width == WIDTH
    message = refusal(data, probe_image, max_pixels=WIDTH * HEIGHT - 1)
    assert f"{WIDTH}x{HEIGHT} = {WIDTH * HEIGHT} pixels" in message
    assert f"at most {WIDTH * HEIGHT - 1} pixels" in message


def test_empty_bytes_are_refused() -> None:
    message = refusal(b"")
    assert "empty" in message and ALLOWED_TEXT in message


def test_text_is_refused() -> None:
    message = refusal(b"hello")
    assert "not an image" in message and ALLOWED_TEXT in message


def test_random_bytes_are_refused() -> None:
    data = np.random.default_rng(1).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    message = refusal(data)
    assert ALLOWED_TEXT in message


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_format_not_allowed_is_refused_by_name(fmt: str) -> None:
    message = refusal(encode(rgb_image(), fmt), probe_image)
    assert f"format {fmt} is not allowed" in message and ALLOWED_TEXT in message


def test_truncated_png_is_refused() -> None:
    data = encode(rgb_image(), "PNG")
    truncated = data[: len(data) // 2]
    probe_image(truncated, FIELD)  # the header is whole: only decoding finds the rest missing
    message = refusal(truncated)
    assert "cannot decode the PNG image" in message and "truncated" in message and ALLOWED_TEXT in message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_file_cut_inside_its_header_is_refused(fmt: str) -> None:
    message = refusal(encode(rgb_image(), fmt)[:20], probe_image)
    assert f"cannot read the header of the {fmt} file" in message and ALLOWED_TEXT in message


def test_truncated_jpeg_is_refused() -> None:
    data = encode(rgb_image(), "JPEG")
    truncated = data[: len(data) // 2]
    probe_image(truncated, FIELD)
    message = refusal(truncated)
    assert "cannot decode the JPEG image" in message and "truncated" in message and ALLOWED_TEXT in message


def test_truncated_webp_is_refused() -> None:
    data = encode(rgb_image(), "WEBP")
    message = refusal(data[: len(data) // 2])  # Pillow's WebP reader needs the whole file to open it
    assert "WEBP" in message and ALLOWED_TEXT in message


def test_jpeg_missing_its_last_bytes_is_refused() -> None:
    data = encode(rgb_image(), "JPEG")
    message = refusal(data[:-1])
    assert "truncated" in message


def test_corrupt_png_data_is_refused() -> None:
    data = bytearray(encode(rgb_image(), "PNG"))
    start = data.find(b"IDAT") + 4
    data[start + 10 : start + 40] = bytes(30)  # zeroes in the middle of the compressed pixels
    message = refusal(bytes(data))
    assert "cannot decode the PNG image" in message


def test_decompression_bomb_over_pillows_own_limit_is_refused_fast() -> None:
    data = png_declaring(100_000, 100_000)  # 10^10 pixels, 30 GB as RGB, in a file of a few KB
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe_message = refusal(data, probe_image)
        decode_message = refusal(data)
    assert time.perf_counter() - started < 1.0
    assert caught == []
    for message in (probe_message, decode_message):
        assert f"at most {MAX_IMAGE_PIXELS} pixels (width*height)" in message


def test_decompression_bomb_is_refused_by_the_pixel_check_fast() -> None:
    # 10^8 pixels: over our limit and over Pillow's warning limit, under its error limit.
    data = png_declaring(10_000, 10_000)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = refusal(data)
    assert time.perf_counter() - started < 1.0
    assert caught == []  # Pillow's DecompressionBombWarning is not shown
    assert f"10000x10000 = 100000000 pixels; send at most {MAX_IMAGE_PIXELS} pixels (width*height)" in message


def test_image_just_over_the_default_limit_is_refused() -> None:
    message = refusal(png_declaring(4097, 4096), probe_image)
    assert f"4097x4096 = {4097 * 4096} pixels; send at most {MAX_IMAGE_PIXELS} pixels" in message


def test_pillow_global_limits_are_left_alone_and_only_pillows_warnings_are_filtered() -> None:
    before = (Image.MAX_IMAGE_PIXELS, warnings.filters[:])
    refusal(png_declaring(100_000, 100_000))
    refusal(png_declaring(10_000, 10_000))
    decode_image(encode(rgb_image(), "PNG"), FIELD)
    assert before[0] == Image.MAX_IMAGE_PIXELS
    added = [entry for entry in warnings.filters if entry not in before[1]]
    assert all(entry[0] == "ignore" for entry in added)
    assert {(entry[2], getattr(entry[3], "pattern", entry[3])) for entry in added} <= {
        (Warning, r"PIL\."),
        (Image.DecompressionBombWarning, None),
    }
    with pytest.warns(UserWarning, match="not Pillow's"):  # other modules' warnings still show
        warnings.warn("not Pillow's", UserWarning, stacklevel=1)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_image_is_refused(fmt: str) -> None:
    data = encode(rgb_image(0), fmt, save_all=True, append_images=[rgb_image(1), rgb_image(2)])
    message = refusal(data, probe_image)
    assert "animated image (3 frames)" in message and "send a single frame" in message and ALLOWED_TEXT in message


def test_jpeg_holding_several_pictures_is_its_first_picture() -> None:
    # Pillow names a JPEG with a Multi-Picture Format index (a phone's gain map, a stereo pair) "MPO".
    data = encode(rgb_image(0), "MPO", save_all=True, append_images=[rgb_image(1)])
    assert probe_image(data, "images[0].data").format == "JPEG"
    expected = np.asarray(load_image(Image.open(BytesIO(data))))
    np.testing.assert_array_equal(np.asarray(decode_image(data, "images[0].data")), expected)


def test_rgb_png_decodes_exactly() -> None:
    array = pixels(3)
    got = assert_decodes_like_load_image(encode(Image.fromarray(array, "RGB"), "PNG"))
    np.testing.assert_array_equal(got, array)


def test_rgba_png_drops_alpha_without_compositing() -> None:
    array = pixels(4)
    array[0, 0, 3] = 0  # a fully transparent pixel keeps the colour stored under it
    got = assert_decodes_like_load_image(encode(Image.fromarray(array, "RGBA"), "PNG"))
    np.testing.assert_array_equal(got, array[..., :3])


def test_la_png_decodes_exactly() -> None:
    array = pixels(2)
    got = assert_decodes_like_load_image(encode(Image.fromarray(array, "LA"), "PNG"))
    np.testing.assert_array_equal(got, np.repeat(array[..., :1], 3, axis=-1))


def test_grayscale_png_decodes_exactly() -> None:
    array = pixels(1)
    got = assert_decodes_like_load_image(encode(Image.fromarray(array, "L"), "PNG"))
    np.testing.assert_array_equal(got, np.repeat(array[..., None], 3, axis=-1))


def test_bilevel_png_decodes_exactly() -> None:
    bits = pixels(1, high=2).astype(bool)
    got = assert_decodes_like_load_image(encode(Image.fromarray(bits), "PNG"))
    np.testing.assert_array_equal(got, np.repeat(np.where(bits, 255, 0)[..., None], 3, axis=-1).astype(np.uint8))


def palette_image() -> Image.Image:
    image = Image.fromarray(pixels(1, high=16), "P")
    image.putpalette(pixels(3, seed=5)[0, :16].flatten().tolist())
    return image


def test_palette_png_decodes_exactly() -> None:
    assert_decodes_like_load_image(encode(palette_image(), "PNG"))


def test_palette_png_with_one_transparent_index_decodes_exactly() -> None:
    data = encode(palette_image(), "PNG", transparency=3)
    assert Image.open(BytesIO(data)).info["transparency"] == 3
    assert_decodes_like_load_image(data)


def test_palette_png_with_alpha_per_index_decodes_exactly_and_quietly() -> None:
    data = encode(palette_image(), "PNG", transparency=bytes(range(0, 256, 16)))
    assert isinstance(Image.open(BytesIO(data)).info["transparency"], bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_image(data, FIELD)
    assert caught == []  # load_image warns "Palette images with Transparency expressed in bytes ..."
    assert_decodes_like_load_image(data)


def test_cmyk_jpeg_decodes_exactly() -> None:
    data = encode(Image.fromarray(pixels(4), "CMYK"), "JPEG", quality=90)
    assert Image.open(BytesIO(data)).mode == "CMYK"
    assert_decodes_like_load_image(data)


def test_grayscale_jpeg_decodes_exactly() -> None:
    assert_decodes_like_load_image(encode(Image.fromarray(pixels(1), "L"), "JPEG"))


def test_rgb_jpeg_decodes_exactly() -> None:
    assert_decodes_like_load_image(encode(rgb_image(), "JPEG", quality=85))


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
@pytest.mark.parametrize("lossless", [True, False])
def test_webp_decodes_exactly(mode: str, lossless: bool) -> None:
    image = Image.fromarray(pixels(len(mode)), mode)
    # exact: keep the colour under fully transparent pixels (libwebp's lossless encoder zeroes it otherwise)
    got = assert_decodes_like_load_image(encode(image, "WEBP", lossless=lossless, exact=True))
    if lossless:
        np.testing.assert_array_equal(got, np.asarray(image)[..., :3])


def test_16_bit_grayscale_png_is_clipped_like_load_image() -> None:
    array = pixels(1, dtype=np.uint16, high=65536)
    array[0, :8] = [0, 1, 100, 254, 255, 256, 1000, 65535]
    data = encode(Image.fromarray(array), "PNG")
    assert Image.open(BytesIO(data)).mode == "I;16"
    got = assert_decodes_like_load_image(data)
    # Values above 255 are clipped, not scaled: the image is almost all white.
    np.testing.assert_array_equal(got[0, :8, 0], [0, 1, 100, 254, 255, 255, 255, 255])
    np.testing.assert_array_equal(got[..., 0], np.minimum(array, 255).astype(np.uint8))


@pytest.mark.parametrize(("color_type", "channels", "mode"), [(2, 3, "RGB"), (6, 4, "RGBA"), (4, 2, "RGBA")])
def test_16_bit_colour_png_keeps_the_high_byte_like_load_image(color_type: int, channels: int, mode: str) -> None:
    array = pixels(channels, dtype=np.uint16, high=65536)
    data = raw_png(array, bit_depth=16, color_type=color_type)
    assert Image.open(BytesIO(data)).mode == mode
    got = assert_decodes_like_load_image(data)
    high = (array >> 8).astype(np.uint8)
    expected = high[..., :3] if channels >= 3 else np.repeat(high[..., :1], 3, axis=-1)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_jpeg_exif_orientation_is_applied_like_load_image(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(rgb_image(), "JPEG", exif=exif)
    got = assert_decodes_like_load_image(data)
    assert got.shape == ((HEIGHT, WIDTH, 3) if orientation == 3 else (WIDTH, HEIGHT, 3))


def test_decoded_image_outlives_the_encoded_bytes() -> None:
    data = bytearray(encode(rgb_image(), "PNG"))
    decoded = decode_image(bytes(data), FIELD)
    data[:] = bytes(len(data))
    np.testing.assert_array_equal(np.asarray(decoded), pixels(3))


def test_image_roles_follow_the_model() -> None:
    from services.input_images import image_roles
    from stagediff.v1 import image_pb2

    first, last = image_pb2.IMAGE_ROLE_FIRST_FRAME, image_pb2.IMAGE_ROLE_LAST_FRAME
    roles, required = ("first_frame", "last_frame"), ("first_frame",)
    unspecified = image_pb2.InputImage(data=b"x")
    assert image_roles([unspecified], roles, required, "m") == ["first_frame"]
    assert image_roles([image_pb2.InputImage(role=last), unspecified], roles, required, "m") == [
        "last_frame",
        "first_frame",
    ]
    refusals = [
        ([unspecified], (), (), "images: model 'm' takes no input images"),
        ([image_pb2.InputImage(role=last)], roles, required, "images: model 'm' requires a first_frame image"),
        ([unspecified, image_pb2.InputImage(role=first)], roles, required, "images[1].role: a second first_frame"),
        ([image_pb2.InputImage(role=image_pb2.IMAGE_ROLE_REFERENCE)], roles, required, "images[0].role: model 'm'"),
        ([image_pb2.InputImage(role=17)], roles, required, "images[0].role: 17 is not an ImageRole"),
    ]
    for images, model_roles, model_required, message in refusals:
        with pytest.raises(RequestError) as refused:
            image_roles(images, model_roles, model_required, "m")
        assert str(refused.value).startswith(message), str(refused.value)


def _mutations(base: bytes):
    from hypothesis import strategies as st

    @st.composite
    def mutate(draw) -> bytes:
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            operation = draw(st.sampled_from(("replace", "cut", "insert")))
            if operation == "replace" and data:
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
            elif operation == "cut":
                data = data[: draw(st.integers(0, len(data)))]
            else:
                at = draw(st.integers(0, len(data)))
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
        return bytes(data)

    return mutate()


def _fuzz_bases() -> list[bytes]:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (12, 9, 3), dtype=np.uint8))
    bases = []
    for format, options in (("PNG", {}), ("JPEG", {"quality": 80}), ("WEBP", {"lossless": True}), ("WEBP", {})):
        buffer = BytesIO()
        image.save(buffer, format=format, **options)
        bases.append(buffer.getvalue())
    return bases


def test_fuzzed_image_bytes_decode_or_are_refused_naming_the_field() -> None:
    """Mangled PNG, JPEG and WebP files and random bytes: an RGB image or a RequestError, nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(*[_mutations(base) for base in _fuzz_bases()], st.binary(max_size=256)))
    def check(data: bytes) -> None:
        try:
            image = decode_image(data, "images[0].data")
        except RequestError as error:
            assert str(error).startswith("images[0].data: "), str(error)
            return
        assert image.mode == "RGB" and image.width * image.height <= MAX_IMAGE_PIXELS

    check()
