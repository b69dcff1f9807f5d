"""Encoded results: a video encoder's memory is bounded by capping its threads and lookahead.

An encoder holds every frame it looks ahead at, so the frames it takes before its first packet are the frames it
holds; x264 also writes the settings it ran with into the stream, where the threads and lookahead can be read.
"""

from __future__ import annotations

import re

import av
import numpy as np
import pytest

from services.encoding import ENCODER_LOOKAHEAD_FRAMES, ENCODER_THREADS, OUTPUT_FORMATS, ResultEncoder

SIDE = 64
# x264 holds one frame beyond its lookahead; libvpx fewer than its lag.
HELD_BEYOND_LOOKAHEAD = 2


def _frames_held(encoder: ResultEncoder, most: int) -> int:
    """Noise frames fed to the encoder's codec before it gives back its first packet."""
    rng = np.random.default_rng(0)
    for index in range(most):
        frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8), format="rgb24")
        frame.pts = index
        if encoder._stream.encode(frame):
            return index
    return most


@pytest.mark.parametrize("name", ["mp4", "webm"])
def test_a_video_encoder_holds_at_most_its_lookahead_of_frames(name: str) -> None:
    encoder = ResultEncoder(OUTPUT_FORMATS[name], None, SIDE, SIDE, 16.0)
    try:
        held = _frames_held(encoder, most=64)
    finally:
        encoder.close()
    assert held <= ENCODER_LOOKAHEAD_FRAMES + HELD_BEYOND_LOOKAHEAD, f"{name} held {held} frames"


def test_x264_runs_with_the_capped_threads_and_lookahead() -> None:
    """Frames as large as a request makes: x264's own choice of threads grows with them and with the cores."""
    encoder = ResultEncoder(OUTPUT_FORMATS["mp4"], None, 1088, 1920, 16.0)
    data = encoder.add(np.zeros((2, 1088, 1920, 3), np.uint8)) + encoder.finish()
    settings = re.search(rb"options: ([^\x00]*)", data)
    assert settings is not None, "x264 wrote no settings into the stream"
    values = dict(item.split(b"=", 1) for item in settings.group(1).split() if b"=" in item)
    assert int(values[b"rc_lookahead"]) <= ENCODER_LOOKAHEAD_FRAMES
    assert int(values[b"threads"]) <= ENCODER_THREADS
