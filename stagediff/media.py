"""Writing generated frames to files: H.264 .mp4 for watching, .png for a single image, .npz for exact comparisons;
decoding a result the server encoded (mp4, webm, gif, png, jpeg, webp) back to frames; and reading input images
into the encoded bytes a request carries.

Frames are uint8 RGB [F, H, W, 3] throughout. The .npz form is lossless and holds `frames` and `fps`; it is what
tests and parity checks compare.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.codec.codec import UnknownCodecError
from PIL import Image

from stagediff.protocol import MEDIA_TYPE_EXTENSIONS

SUPPORTED_EXTENSIONS = (".mp4", ".png", ".npz")

H264_ENCODERS = ("libx264", "libopenh264", "h264")
"""H.264 encoders tried in order. PyAV's wheels bundle an FFmpeg with libx264; other builds may only have
OpenH264, and "h264" picks whatever default H.264 encoder the FFmpeg build has."""

MP4_CRF = 18
"""libx264 constant rate factor: visually lossless for generated video at a modest size."""

MP4_BITS_PER_PIXEL = 0.3
"""Bitrate for encoders without a quality mode (OpenH264), in bits per pixel per frame."""

MP4_MIN_BIT_RATE = 1_000_000

# Media types decoded as video with PyAV (every frame); the others are single images, decoded with Pillow.
VIDEO_MEDIA_TYPES = ("video/mp4", "video/webm", "image/gif")

# Largest denominator of the frame rate's fraction; enough for NTSC rates such as 30000/1001 and for any rate
# given to a few decimals.
_MAX_RATE_DENOMINATOR = 100_000


def save_frames(path: str | Path, frames: np.ndarray, fps: float) -> Path:
    """Write frames to `path`, the format chosen by its extension; parent directories are created.

    Args:
        path: a .mp4 (H.264, yuv420p), .png (exactly one frame) or .npz (`frames` and `fps`, lossless) file.
        frames: uint8 RGB frames [F, H, W, 3] with F >= 1.
        fps: frames per second, > 0; may be fractional (e.g. 23.976).

    Returns:
        The path written.
    """
    path = Path(path)
    extension = path.suffix.lower()
    if extension not in SUPPORTED_EXTENSIONS:
        allowed = ", ".join(SUPPORTED_EXTENSIONS)
        raise ValueError(f"path: extension {path.suffix or '(none)'!r} is not supported; use one of {allowed}")
    _check_frames(frames)
    fps = _check_fps(fps)
    if extension == ".png" and len(frames) != 1:
        raise ValueError(
            f"frames: .png holds exactly one frame, got {len(frames)}; use .mp4 or .npz for several frames"
        )

    path.parent.mkdir(parents=True, exist_ok=True)
    if extension == ".mp4":
        _write_mp4(path, frames, fps)
    elif extension == ".png":
        Image.fromarray(np.ascontiguousarray(frames[0])).save(path, format="PNG")
    else:
        with path.open("wb") as file:  # a file object, so numpy keeps the name as given (it appends .npz to others)
            np.savez_compressed(file, frames=frames, fps=np.asarray(fps, dtype=np.float64))
    return path


def load_npz(path: str | Path) -> tuple[np.ndarray, float]:
    """Read a file written by `save_frames(..., ".npz")`: uint8 frames [F, H, W, 3] and fps."""
    with np.load(Path(path), allow_pickle=False) as data:
        missing = {"frames", "fps"} - set(data.files)
        if missing:
            raise ValueError(f"path: {path} lacks {', '.join(sorted(missing))}; expected 'frames' and 'fps' arrays")
        return data["frames"], float(data["fps"])


def read_video_frames(path: str | Path) -> np.ndarray:
    """Decode the first video stream of a file to uint8 RGB frames [F, H, W, 3].

    An .mp4 written by `save_frames` from frames of odd height or width decodes one row or column larger: see
    `_pad_to_even`.
    """
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ValueError(f"path: {path} holds no video frames")
    return np.stack(frames)


def decode_media(data: bytes, media_type: str) -> np.ndarray:
    """Decode an encoded result to uint8 RGB frames [F, H, W, 3].

    Video (video/mp4, video/webm, image/gif) is decoded with PyAV, every frame of its first video stream; an
    image (image/png, image/jpeg, image/webp) with Pillow, as one frame. The lossy formats give back approximately
    the frames the server encoded, and an odd height or width comes back one larger from mp4 and webm (see
    `_pad_to_even`).
    """
    if media_type in VIDEO_MEDIA_TYPES:
        with av.open(io.BytesIO(data), mode="r") as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        if not frames:
            raise ValueError(f"data: the {media_type} file holds no video frames")
        return np.stack(frames)
    if media_type in MEDIA_TYPE_EXTENSIONS:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))[None]
    allowed = ", ".join(MEDIA_TYPE_EXTENSIONS)
    raise ValueError(f"media_type: {media_type!r} cannot be decoded; allowed: {allowed}")


def _write_mp4(path: Path, frames: np.ndarray, fps: float) -> None:
    """Encode to H.264 with the first encoder in H264_ENCODERS that this FFmpeg build has and can open."""
    rate = Fraction(fps).limit_denominator(_MAX_RATE_DENOMINATOR)
    padded = _pad_to_even(frames)
    failures = []
    for encoder in H264_ENCODERS:
        try:
            _encode_h264(path, padded, rate, encoder)
            return
        except UnknownCodecError:
            failures.append(f"{encoder}: not in this build")
        except av.FFmpegError as error:
            failures.append(f"{encoder}: {error}")
    path.unlink(missing_ok=True)
    raise RuntimeError(
        f"no H.264 encoder works in PyAV's FFmpeg (tried {', '.join(H264_ENCODERS)}): {'; '.join(failures)}. "
        "Install a PyAV build with libx264 or OpenH264, or save as .npz"
    )


def _encode_h264(path: Path, frames: np.ndarray, rate: Fraction, encoder: str) -> None:
    height, width = frames.shape[1:3]
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream(encoder, rate=rate)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = 1 / rate
        if stream.codec_context.codec.name == "libx264":
            stream.codec_context.options = {"crf": str(MP4_CRF)}
        else:
            stream.codec_context.bit_rate = max(MP4_MIN_BIT_RATE, int(MP4_BITS_PER_PIXEL * width * height * rate))
        for index, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
            frame.pts = index
            frame.time_base = stream.codec_context.time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Repeat the last row and/or column so that height and width are even.

    yuv420p stores chroma at half resolution, so H.264 encoders refuse odd sizes, and H.264 can crop the picture
    only in steps of 2 pixels in 4:2:0; the extra row or column therefore stays in the file. Repeating edge pixels
    (rather than black) keeps it invisible and cheap to encode. Use .npz where the exact size matters.
    """
    pad_rows = frames.shape[1] % 2
    pad_cols = frames.shape[2] % 2
    if not pad_rows and not pad_cols:
        return frames
    return np.pad(frames, ((0, 0), (0, pad_rows), (0, pad_cols), (0, 0)), mode="edge")


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray):
        raise ValueError(
            f"frames: expected a numpy array of uint8 RGB frames [F, H, W, 3], got {type(frames).__name__}"
        )
    if frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames: shape {list(frames.shape)} is not allowed; expected [F, H, W, 3]")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames: dtype {frames.dtype} is not allowed; expected uint8")
    if frames.shape[0] < 1 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"frames: shape {list(frames.shape)} is not allowed; F, H and W must be at least 1")


def _check_fps(fps: float) -> float:
    try:
        value = float(fps)
    except (TypeError, ValueError):
        raise ValueError(f"fps: {fps!r} is not allowed; use a number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"fps: {fps!r} is not allowed; use a finite number > 0")
    return value


# What `encode_image` takes: a file's path, its bytes, a PIL image, or a uint8 array [H, W], [H, W, 3] or [H, W, 4].
ImageLike = str | Path | bytes | Image.Image | np.ndarray


def encode_image(image: ImageLike) -> bytes:
    """The encoded bytes of an input image, as a request carries them.

    A file (PNG, JPEG, WebP) is sent as it is, so the server decodes exactly what is on disk; a PIL
    image or an array is encoded losslessly as PNG. The server checks the format and size.
    """
    if isinstance(image, bytes):
        return image
    if isinstance(image, (str, Path)):
        return Path(image).expanduser().read_bytes()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise ValueError(
                f"image: a {image.dtype} array of shape {list(image.shape)}; use uint8 [H, W], [H, W, 3] or [H, W, 4]"
            )
        image = Image.fromarray(image)
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"image: {type(image).__name__} is not a path, bytes, PIL image or uint8 array")
