"""Input images of generation requests: encoded bytes a client sends, checked and decoded with Pillow.

The bytes are untrusted (empty, not an image, a format not served, an animation, truncated, corrupt, or a
decompression bomb): each case is refused with a RequestError (INVALID_ARGUMENT) whose message starts with the
field (e.g. "images[0].data: ...") and says what is allowed.

Rules:
- `probe_image` reads only the header (format, size, frame count), so the orchestrator refuses a request
  without decoding it; nothing here imports torch. `decode_image` gives exactly what
  `diffusers.utils.load_image` gives (`exif_transpose`, then `.convert("RGB")`), surprises included.
- Only Pillow's PNG, JPEG and WebP readers ever parse the bytes, and only once `check_structure`
  (services/image_structure.py) has bounded the file's scans, segments and header bytes. An MPO is a JPEG.
- Global Pillow settings are never changed (LOAD_TRUNCATED_IMAGES stays off); Pillow's warnings about a
  client's bytes are ignored by filters installed once, so decodes take no lock and run side by side.
- Decoding reads through a `Stop` check, so a decode ends within one block of a cancel or its deadline.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from dataclasses import dataclass
from io import BytesIO
from typing import Literal

from PIL import ExifTags, Image, ImageFile, ImageOps

from services.image_structure import check_structure
from stagekit.errors import RequestError, bounded

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_IMAGE_PIXELS = 4096 * 4096  # default limit on width*height of one image
MAX_IMAGE_BYTES = 16 << 20  # default limit on the encoded bytes of all images of one request together

_ALLOWED_TEXT = ", ".join(ALLOWED_FORMATS[:-1]) + " or " + ALLOWED_FORMATS[-1]  # "PNG, JPEG or WEBP"


# EXIF orientations that `ImageOps.exif_transpose` turns by a quarter (transpose, rotate 270, transverse,
# rotate 90): the decoded image's width and height are the stored height and width.
_QUARTER_TURNS = (5, 6, 7, 8)


@dataclass(frozen=True)
class ImageInfo:
    format: str  # Pillow's name of the format, one of ALLOWED_FORMATS
    width: int  # as stored, before the EXIF orientation is applied
    height: int
    sha256: str  # hex digest of the encoded bytes
    orientation: int = 1  # the EXIF orientation tag the header gives (1 when there is none)

    @property
    def decoded_size(self) -> tuple[int, int]:
        """(width, height) of the image `decode_image` makes: the stored size, turned by the orientation."""
        if self.orientation in _QUARTER_TURNS:
            return self.height, self.width
        return self.width, self.height


# The filters that keep Pillow's warnings about clients' bytes out of the logs: anything Pillow's own modules
# warn, and the decompression-bomb warning wherever it is attributed.
_PILLOW_FILTERS: tuple[tuple[Literal["ignore"], None, type[Warning], str | None, int], ...] = (
    ("ignore", None, Warning, r"PIL\.", 0),
    ("ignore", None, Image.DecompressionBombWarning, None, 0),
)


def _ignore_pillow_warnings() -> None:
    """Installs the Pillow warning filters where they are missing (a test harness may have reset them).

    Adding a filter is idempotent, so threads that race here at most add it twice; nothing is swapped and
    restored, which is what made a per-call `warnings.catch_warnings` need a process-wide lock.
    """
    current = warnings.filters
    for action, _, category, module, _ in _PILLOW_FILTERS:
        if not any(f[0] == action and f[2] is category and getattr(f[3], "pattern", f[3]) == module for f in current):
            warnings.filterwarnings(action, category=category, module=module or "")


class Stop:
    """When a decode must give up: its caller was cancelled (`cancel()`), or it ran past `deadline_s`.

    Made by the caller before the work is queued; the clock starts when the work starts (`start()`), so
    time spent waiting for a worker does not count against the image.
    """

    def __init__(self, deadline_s: float | None = None) -> None:
        self.deadline_s = deadline_s
        self._cancelled = threading.Event()
        self._ends: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def start(self) -> None:
        if self.deadline_s is not None:
            self._ends = time.monotonic() + self.deadline_s

    def check(self, field: str) -> None:
        """Raises DecodeCancelled once cancelled, RequestError (naming `field`) past the deadline."""
        if self._cancelled.is_set():
            raise DecodeCancelled(field)
        if self._ends is not None and time.monotonic() > self._ends:
            raise RequestError(
                f"{field}: decoding the image took more than {self.deadline_s:g} s; send a smaller or simpler "
                f"{_ALLOWED_TEXT} file"
            )


class DecodeCancelled(Exception):
    """The caller of a decode gave up (its call or job was cancelled); nobody waits for the result."""


class _CheckedReader(BytesIO):
    """The file's bytes, read by Pillow a block at a time, each read first asking `stop` whether to go on."""

    def __init__(self, data: bytes, stop: Stop, field: str) -> None:
        super().__init__(data)
        self._stop, self._field = stop, field

    def read(self, size: int | None = -1, /) -> bytes:
        self._stop.check(self._field)
        return super().read(size)


# Bytes Pillow hands its decoder per read (its default is 64 KiB): how far a decode runs past a Stop.
_DECODE_BLOCK_BYTES = 16 << 10


def _format_by_signature(data: bytes) -> str | None:
    """The Pillow format whose signature `data` starts with (e.g. "GIF"), found without parsing the file."""
    Image.init()
    prefix = data[:16]  # what Image.open hands the same functions
    for name in Image.ID:
        _, accept = Image.OPEN[name]
        if accept is None:
            continue  # a format with no signature: it could only be told by parsing
        try:
            found = accept(prefix)
        except Exception:
            continue
        if found and not isinstance(found, str):  # a string is Pillow's "could be, but unsupported"
            return name
    return None


def _open(data: bytes, field: str, max_pixels: int, stop: Stop) -> tuple[ImageFile.ImageFile, ImageInfo]:
    """The lazily opened image (nothing decoded yet) and its info, once every check on its header passed."""
    if not data:
        raise RequestError(f"{field}: the image is empty; send the encoded bytes of a {_ALLOWED_TEXT} image")
    check_structure(data, field)
    _ignore_pillow_warnings()
    try:
        image = Image.open(_CheckedReader(data, stop, field), formats=ALLOWED_FORMATS)
    except (DecodeCancelled, RequestError):
        raise
    except Image.DecompressionBombError:
        # Pillow refuses, before we can, an image over twice its own limit (raised only when that is set).
        pillow_limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise RequestError(
            f"{field}: the image has more than {pillow_limit} pixels; "
            f"send at most {min(max_pixels, pillow_limit)} pixels (width*height)"
        ) from None
    except Exception as error:
        # Either no allowed reader recognised the signature (UnidentifiedImageError, whose text only names the
        # buffer), or one did and then failed on what follows (e.g. a truncated WebP, a PNG cut in its header).
        found = _format_by_signature(data)
        if found is None:
            raise RequestError(f"{field}: not an image Pillow can identify; send a {_ALLOWED_TEXT} image") from None
        if found not in ALLOWED_FORMATS:
            raise RequestError(f"{field}: image format {found} is not allowed; send a {_ALLOWED_TEXT} image") from None
        detail = "" if isinstance(error, Image.UnidentifiedImageError) else f" ({error})"
        raise RequestError(
            bounded(
                f"{field}: cannot read the header of the {found} file{detail}; send a complete {_ALLOWED_TEXT} file"
            )
        ) from None

    info = ImageInfo(
        format=str(image.format),
        width=image.width,
        height=image.height,
        sha256=hashlib.sha256(data).hexdigest(),
        orientation=_header_orientation(image),
    )
    frames = getattr(image, "n_frames", 1)
    if info.format == "MPO":
        # Pillow's JPEG reader names a JPEG that holds several pictures (MPF) "MPO"; the first is the image.
        info = ImageInfo("JPEG", info.width, info.height, info.sha256)
        frames = 1
    if info.format not in ALLOWED_FORMATS:
        image.close()
        raise RequestError(f"{field}: image format {info.format} is not allowed; send a {_ALLOWED_TEXT} image")
    if info.width < 1 or info.height < 1 or info.width * info.height > max_pixels:
        image.close()
        raise RequestError(
            f"{field}: the image is {info.width}x{info.height} = {info.width * info.height} pixels; "
            f"send at most {max_pixels} pixels (width*height)"
        )
    if frames > 1:
        image.close()
        raise RequestError(
            f"{field}: an animated image ({frames} frames) is not allowed; send a single frame {_ALLOWED_TEXT} image"
        )
    return image, info


def _header_orientation(image: Image.Image) -> int:
    """The EXIF orientation `ImageOps.exif_transpose` will apply, from what opening the file read.

    `Image.getexif` of the base class reads the EXIF and XMP already parsed from the header; PngImageFile's
    own would decode the whole image first. An unreadable EXIF block counts as none here; decoding fails
    on it, or ignores it, as Pillow does.
    """
    try:
        orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation, 1)
    except Exception:
        return 1
    return orientation if isinstance(orientation, int) else 1


def probe_image(data: bytes, field: str, max_pixels: int = MAX_IMAGE_PIXELS, stop: Stop | None = None) -> ImageInfo:
    """Format, size and sha256 of an encoded image, read from its header only; RequestError if it is refused."""
    stop = stop if stop is not None else Stop()
    stop.check(field)
    image, info = _open(data, field, max_pixels, stop)
    image.close()
    return info


def decode_image(data: bytes, field: str, max_pixels: int = MAX_IMAGE_PIXELS, stop: Stop | None = None) -> Image.Image:
    """The RGB image an encoded image holds, as `diffusers.utils.load_image` makes it; RequestError if refused.

    As load_image: alpha is dropped, not composited (a transparent pixel becomes the colour stored under it);
    a 16-bit grayscale PNG (mode "I;16") is clipped to 255, not scaled (16-bit RGB, RGBA and gray+alpha PNGs
    open as 8-bit); ICC profiles are ignored and CMYK JPEGs use Pillow's plain formula; the EXIF orientation
    is applied (`ImageInfo.decoded_size` gives the size that results). A JPEG with a Multi-Picture Format
    index ("MPO" to Pillow) gives its first picture. Pillow's own decompression-bomb error (above twice
    Image.MAX_IMAGE_PIXELS) becomes the same refusal as ours.

    Probes first, so nothing is decoded for an image refused by its header.
    A file that fails to decode (truncated, corrupt) is refused too: Pillow
    raises OSError for most such files, and ValueError, SyntaxError or
    struct.error for some malformed ones, so any exception from decoding a
    client's bytes is taken as theirs. `stop` ends the decode early
    (DecodeCancelled, or RequestError past its deadline).
    """
    stop = stop if stop is not None else Stop()
    stop.check(field)
    image, info = _open(data, field, max_pixels, stop)
    image.decodermaxblock = _DECODE_BLOCK_BYTES
    try:
        image.load()
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    except (DecodeCancelled, RequestError):
        raise
    except Exception as error:
        raise RequestError(
            bounded(
                f"{field}: cannot decode the {info.format} image ({error}); "
                f"send a complete, uncorrupted {_ALLOWED_TEXT} file"
            )
        ) from None
    finally:
        image.close()
    return rgb
