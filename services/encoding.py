"""Encoded results: the formats a request may ask for (`GenerateRequest.output_format`) and their encoder.

A job's final frames reach the orchestrator piece by piece (the VAE or the interpolator streams them). With an
encoded format, each piece is also fed to a `ResultEncoder` as it is written, and whatever bytes the container
has produced meanwhile go straight to the job's encoded file and on to its followers: an MP4 is written
fragmented (`frag_keyframe+empty_moov`: a header first, then a self-contained fragment per keyframe), so a
client receives, and a browser can start playing, the first second of video while the DiT's later frames are
still being decoded. WebM streams the same way; GIF and the single-image formats are produced at the end.

Video goes through PyAV (FFmpeg's libx264, libvpx-vp9 and GIF encoders in its wheels), images through Pillow.
A model that makes sound (`AudioTrack`) has it muxed beside the video: AAC in MP4, Opus in WebM (both in PyAV's
wheels); GIF and the image formats carry none. The sound is added whole, before or between the frames: the muxer
interleaves the two streams by time, so the fragments a client receives hold both.
`quality` is one 1-100 scale across the lossy formats (OpenAI's `output_compression` is the same idea); for the
codecs with a constant-quality factor it maps linearly onto it: mp4's default 65 is x264's CRF 18.

Memory. A video encoder holds the frames it looks ahead at (x264's `rc-lookahead`, libvpx's `lag-in-frames`) and
buffers per thread, each the size of a frame, and by default picks both from the machine's cores: an encode's
memory is bounded by capping them (ENCODER_THREADS, ENCODER_LOOKAHEAD_FRAMES), so that it depends on the frame
size alone (docs/operations.md gives the bound at the largest frames).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

# Frame rates are kept as fractions with at most this denominator (NTSC's 30000/1001 fits).
_MAX_RATE_DENOMINATOR = 100_000
# Frames between keyframes of a streamed video, in seconds of video: each keyframe starts a fragment that a
# client can play, so this is how much video a follower waits for between deliveries.
_KEYFRAME_INTERVAL_S = 1.0
# Threads of one video encode, whatever the machine's cores (the codecs' default is one per core or more).
ENCODER_THREADS = 2
# Frames a video encoder may hold back to plan its bitrate: x264's rc-lookahead (default 40) and libvpx's
# lag-in-frames (default 25). Each is a frame's worth of memory, or more.
ENCODER_LOOKAHEAD_FRAMES = 8
# Each video codec's name for its lookahead.
_LOOKAHEAD_OPTION = {"libx264": "rc-lookahead", "libvpx-vp9": "lag-in-frames"}
# The sample rates Opus encodes at; sound at any other rate is resampled to 48 kHz by the encoder.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_LAYOUTS = {1: "mono", 2: "stereo"}


@dataclass(frozen=True)
class OutputFormat:
    name: str
    media_type: str
    extension: str
    # A video takes any number of frames; an image format exactly one.
    video: bool
    # The default of a lossy format's 1-100 quality; None: lossless or palette-based, a quality is refused.
    default_quality: int | None = None
    # PyAV encoder and the constant-quality option it takes, for the video formats.
    codec: str = ""
    quality_option: str = ""
    quality_scale: int = 0  # the option's worst value (its best is 0)
    # PyAV encoder of the sound track, for the formats that carry one.
    audio_codec: str = ""


@dataclass(frozen=True)
class AudioTrack:
    """A result's sound: its sample rate (Hz) and channels (1 or 2), as the model's vocoder makes it."""

    sample_rate: int
    channels: int


RAW = "raw"
OUTPUT_FORMATS: dict[str, OutputFormat] = {
    output.name: output
    for output in (
        OutputFormat(RAW, "application/x-npy", ".npy", video=True),
        OutputFormat(
            "mp4",
            "video/mp4",
            ".mp4",
            video=True,
            default_quality=65,
            codec="libx264",
            quality_option="crf",
            quality_scale=51,
            audio_codec="aac",
        ),
        OutputFormat(
            "webm",
            "video/webm",
            ".webm",
            video=True,
            default_quality=65,
            codec="libvpx-vp9",
            quality_option="crf",
            quality_scale=63,
            audio_codec="libopus",
        ),
        OutputFormat("gif", "image/gif", ".gif", video=True, codec="gif"),
        OutputFormat("png", "image/png", ".png", video=False),
        OutputFormat("jpeg", "image/jpeg", ".jpg", video=False, default_quality=90),
        OutputFormat("webp", "image/webp", ".webp", video=False, default_quality=90),
    )
}
MEDIA_TYPES = {output.media_type: output for output in OUTPUT_FORMATS.values()}


def output_format(name: str) -> OutputFormat:
    """The format a request names ("" is raw); raises ValueError naming the field and the formats allowed."""
    try:
        return OUTPUT_FORMATS[name or RAW]
    except KeyError:
        raise ValueError(
            f"output_format: {name[:32]!r} is not a format; use one of {', '.join(OUTPUT_FORMATS)}"
        ) from None


def check_output(name: str, quality: int | None, keep_raw_frames: bool, num_frames: int) -> OutputFormat:
    """The request's output format once its fields agree with each other; ValueError naming the field otherwise."""
    output = output_format(name)
    if quality is not None:
        if output.default_quality is None:
            raise ValueError(f"output_quality: output_format {output.name} takes no quality; leave it unset")
        if not 1 <= quality <= 100:
            raise ValueError(f"output_quality: {quality} is not allowed; use 1 (smallest) to 100 (best)")
    if keep_raw_frames and output.name == RAW:
        raise ValueError("keep_raw_frames: the raw frames are the result already; set it with an encoded format")
    if not output.video and num_frames != 1:
        raise ValueError(
            f"output_format: {output.name} holds one image and this request makes {num_frames} frames; "
            "use mp4, webm or gif for a video"
        )
    return output


# GenerateRequest.audio_codec: "" picks the output format's own; "none" leaves the sound out; "raw" is the float32
# waveform as a tensor (output_format raw). Each format's codecs, its default first; gif and images carry none.
AUDIO_NONE = "none"
AUDIO_RAW = "raw"
AUDIO_CODECS: dict[str, tuple[str, ...]] = {RAW: (AUDIO_RAW,), "mp4": ("aac",), "webm": ("opus",)}
_ALL_AUDIO_CODECS = ("", AUDIO_NONE, AUDIO_RAW, "aac", "opus")


def check_audio(codec: str, output: OutputFormat, model: str, sample_rate: int) -> str:
    """The audio_codec a request runs with ("" for a model without sound, "none" for a silent result); ValueError
    naming the field and what is allowed. A format that carries no sound gets "none" for "" (the caller tells
    the job why)."""
    if codec not in _ALL_AUDIO_CODECS:
        raise ValueError(
            f"audio_codec: {codec[:32]!r} is not a codec; use one of {', '.join(repr(c) for c in _ALL_AUDIO_CODECS)}"
        )
    if sample_rate <= 0:
        if codec:
            raise ValueError(f"audio_codec: model '{model}' makes no sound; leave audio_codec empty")
        return ""
    allowed = AUDIO_CODECS.get(output.name, ())
    if codec == AUDIO_NONE:
        return codec
    if not codec:
        return allowed[0] if allowed else AUDIO_NONE
    if codec not in allowed:
        carries = f"carries only {', '.join(allowed)}" if allowed else "carries no sound"
        raise ValueError(
            f"audio_codec: output_format {output.name} {carries}; "
            f"use {' or '.join(repr(c) for c in ('', AUDIO_NONE, *allowed))}"
        )
    return codec


def memory_bounds(output: OutputFormat, threads: int | None, lookahead_frames: int | None) -> dict[str, str]:
    """The codec options that cap a video encoder's threads and lookahead (None: the codec's default)."""
    bounds = {}
    if output.codec in _LOOKAHEAD_OPTION:
        if threads is not None:
            bounds["threads"] = str(threads)
        if lookahead_frames is not None:
            bounds[_LOOKAHEAD_OPTION[output.codec]] = str(lookahead_frames)
    return bounds


class ResultEncoder:
    """Encodes a result's frames as they arrive: `add` and `finish` return the bytes written meanwhile.

    Blocking (encoding is CPU work): call through `asyncio.to_thread`. One encoder per job attempt; `close`
    abandons it (a failed or cancelled job).
    """

    def __init__(
        self,
        output: OutputFormat,
        quality: int | None,
        height: int,
        width: int,
        fps: float,
        *,
        audio: AudioTrack | None = None,
        threads: int | None = ENCODER_THREADS,
        lookahead_frames: int | None = ENCODER_LOOKAHEAD_FRAMES,
    ) -> None:
        """`audio`: the sound track the result has (`add_audio`), None for a silent one. `threads` and
        `lookahead_frames` bound the encoder's memory; None leaves the codec's default."""
        if output.name == RAW:
            raise ValueError("raw frames are not encoded")
        if audio is not None and not output.audio_codec:
            raise ValueError(f"output_format: {output.name} carries no sound; use mp4 or webm for a video with sound")
        if audio is not None and audio.channels not in _LAYOUTS:
            raise ValueError(f"sound of {audio.channels} channels; this encoder takes 1 or 2")
        self.output = output
        self.quality = quality if quality is not None else output.default_quality
        self.height, self.width = height, width
        self._written: list[bytes] = []
        self._image: np.ndarray | None = None
        self._frames = 0
        self._container: Any = None  # an av OutputContainer once a video is open
        self._bounds = memory_bounds(output, threads, lookahead_frames)
        self.audio = audio
        self._audio_stream: Any = None
        self._audio_samples = 0
        if output.video:
            self._open_video(Fraction(fps).limit_denominator(_MAX_RATE_DENOMINATOR))
        if audio is not None:
            self._open_audio(audio)

    def _open_video(self, rate: Fraction) -> None:
        streaming = {"mp4": {"movflags": "frag_keyframe+empty_moov+default_base_moof"}}.get(self.output.name, {})
        self._container = av.open(self, mode="w", format=self.output.name, options=streaming)
        stream = self._container.add_stream(self.output.codec, rate=rate)
        # 4:2:0 chroma is stored at half size, so H.264 and VP9 take even sizes only: odd frames get their last
        # row or column repeated (see stagediff/media.py).
        stream.width = self.width + self.width % 2 if self.output.name != "gif" else self.width
        stream.height = self.height + self.height % 2 if self.output.name != "gif" else self.height
        stream.pix_fmt = "rgb8" if self.output.name == "gif" else "yuv420p"
        stream.codec_context.time_base = 1 / rate
        options = {}
        if self.output.quality_option and self.quality is not None:
            factor = round(self.output.quality_scale * (100 - self.quality) / 100)
            options[self.output.quality_option] = str(factor)
            options["g"] = str(max(1, round(float(rate) * _KEYFRAME_INTERVAL_S)))
        if self.output.name == "webm":
            options["b"] = "0"  # constant quality: VP9 honours crf only without a target bitrate
            options["deadline"] = "realtime"
            options["cpu-used"] = "8"
        stream.codec_context.options = {**options, **self._bounds}
        self._stream = stream

    def _open_audio(self, audio: AudioTrack) -> None:
        rate = audio.sample_rate
        if self.output.audio_codec == "libopus" and rate not in _OPUS_RATES:
            rate = 48000
        stream = self._container.add_stream(self.output.audio_codec, rate=rate)
        stream.layout = _LAYOUTS[audio.channels]
        self._audio_stream = stream

    def add_audio(self, samples: np.ndarray) -> bytes:
        """Encodes float32 sound [channels, n] in [-1, 1] (more may follow); returns the container bytes so far."""
        if self.audio is None or self._audio_stream is None:
            raise ValueError("this encoder was opened without a sound track")
        if samples.dtype != np.float32 or samples.ndim != 2 or samples.shape[0] != self.audio.channels:
            raise ValueError(
                f"sound of {samples.dtype} {list(samples.shape)}; this encoder takes float32 [{self.audio.channels}, n]"
            )
        if not np.isfinite(samples).all():
            raise ValueError("the sound holds NaN or infinite samples")
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples), format="fltp", layout=_LAYOUTS[self.audio.channels]
        )
        frame.sample_rate = self.audio.sample_rate
        frame.pts = self._audio_samples
        frame.time_base = Fraction(1, self.audio.sample_rate)
        self._audio_samples += samples.shape[1]
        self._container.mux(self._audio_stream.encode(frame))
        return self._take()

    # PyAV writes the container through this (the encoder is its file): bytes are kept until `add` returns them.
    def write(self, data: bytes) -> int:
        self._written.append(bytes(data))
        return len(data)

    def _take(self) -> bytes:
        data = b"".join(self._written)
        self._written.clear()
        return data

    def add(self, frames: np.ndarray) -> bytes:
        """Encodes uint8 frames [n, H, W, 3]; returns the container bytes produced so far (possibly none)."""
        if frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(
                f"frames of shape {list(frames.shape)}; this encoder takes [n, {self.height}, {self.width}, 3]"
            )
        if not self.output.video:
            if self._frames + len(frames) > 1:
                raise ValueError(f"{self.output.name} holds exactly one frame")
            self._image = np.ascontiguousarray(frames[0])
            self._frames += len(frames)
            return b""
        if self._stream.width != self.width or self._stream.height != self.height:
            pad = ((0, 0), (0, self._stream.height - self.height), (0, self._stream.width - self.width), (0, 0))
            frames = np.pad(frames, pad, mode="edge")
        for array in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
            frame.pts = self._frames
            frame.time_base = self._stream.codec_context.time_base
            self._frames += 1
            self._container.mux(self._stream.encode(frame))
        return self._take()

    def finish(self) -> bytes:
        """Flushes the encoder and closes the container; returns the remaining bytes of the file."""
        if self._frames == 0:
            raise ValueError("no frames were encoded")
        if not self.output.video:
            assert self._image is not None  # an image format keeps its one frame until here
            buffer = io.BytesIO()
            options = {"quality": self.quality} if self.quality is not None else {}
            Image.fromarray(self._image).save(buffer, format=self.output.name.upper(), **options)
            return buffer.getvalue()
        self._container.mux(self._stream.encode(None))
        if self._audio_stream is not None:
            self._container.mux(self._audio_stream.encode(None))
        self._container.close()
        self._container = None
        return self._take()

    def close(self) -> None:
        """Abandons the file (nothing more is returned)."""
        if self._container is not None:
            with contextlib.suppress(av.FFmpegError):
                self._container.close()
            self._container = None
        self._written.clear()
