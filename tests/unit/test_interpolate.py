"""Optical-flow frame interpolation: frame counts, originals kept, motion followed, streaming equals batch."""

from __future__ import annotations

import numpy as np
import pytest

from interp_svc.interpolate import (
    MIN_FLOW_SIZE,
    StreamingInterpolator,
    interpolate_midpoints,
    interpolate_sequence,
    output_frame_count,
)


def textured_background(height: int, width: int, seed: int = 0, contrast: float = 6.0) -> np.ndarray:
    """Smoothed noise around grey level 80: texture for the flow to lock on, without repeating patterns."""
    noise = np.random.default_rng(seed).normal(size=(height + 2, width + 2))
    smooth = (4 * noise[1:-1, 1:-1] + noise[:-2, 1:-1] + noise[2:, 1:-1] + noise[1:-1, :-2] + noise[1:-1, 2:]) / 8
    return 80 + contrast * smooth / smooth.std()


def with_square(background: np.ndarray, x: int, y: int = 20, size: int = 6) -> np.ndarray:
    """RGB frame: the background with a bright size x size square whose top-left corner is (x, y)."""
    gray = background.copy()
    gray[y : y + size, x : x + size] = 250
    gray = np.clip(np.rint(gray), 0, 255).astype(np.uint8)
    return np.stack([gray, gray, gray], axis=-1)


def bright_centroid(frame: np.ndarray) -> tuple[float, float]:
    """(x, y) centroid of the pixels brighter than the background can be."""
    weight = np.clip(frame.astype(np.float64).mean(axis=-1) - 160, 0, None)
    ys, xs = np.mgrid[: frame.shape[0], : frame.shape[1]]
    return float((weight * xs).sum() / weight.sum()), float((weight * ys).sum() / weight.sum())


def moving_video(num_frames: int, height: int = 24, width: int = 32, seed: int = 1) -> np.ndarray:
    """A textured background with a square moving 3 px right per frame."""
    background = textured_background(height, width, seed, contrast=20.0)
    return np.stack([with_square(background, x=2 + 3 * i, y=8) for i in range(num_frames)])


def random_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("num_frames", [1, 2, 5])
@pytest.mark.parametrize("exp", [0, 1, 2, 3])
def test_frame_count_and_originals_kept(num_frames: int, exp: int) -> None:
    frames = moving_video(num_frames)
    before = frames.copy()

    out = interpolate_sequence(frames, exp)

    assert out.shape == (output_frame_count(num_frames, exp), *frames.shape[1:])
    assert len(out) == (num_frames - 1) * 2**exp + 1
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out[:: 2**exp], frames)
    np.testing.assert_array_equal(frames, before)  # the input is not modified in place


def test_exp_zero_is_identity() -> None:
    frames = random_frames(4, 20, 30)
    np.testing.assert_array_equal(interpolate_sequence(frames, 0), frames)


def test_single_frame_is_returned_as_is() -> None:
    frame = random_frames(1, 20, 30)
    np.testing.assert_array_equal(interpolate_sequence(frame, 3), frame)


def test_midpoint_follows_a_moving_square() -> None:
    # 64x96 gives DIS enough pyramid levels to find an 8 px motion of a 6 px object.
    background = textured_background(64, 96)
    frame_a, frame_b = with_square(background, x=10), with_square(background, x=18)
    truth = with_square(background, x=14)

    midpoint = interpolate_midpoints(frame_a[None], frame_b[None])[0]

    x, y = bright_centroid(midpoint)
    true_x, true_y = bright_centroid(truth)  # (16.5, 22.5): the square spans x 14..19, y 20..25
    assert abs(x - true_x) <= 1.5 and abs(y - true_y) <= 1.5, (x, y)

    # Around the motion, the interpolated frame is closer to the truth than a cross-fade.
    window = (slice(16, 30), slice(6, 30))
    average = (frame_a.astype(np.float64) + frame_b) / 2
    error_flow = np.abs(midpoint[window].astype(np.float64) - truth[window]).mean()
    error_average = np.abs(average[window] - truth[window]).mean()
    assert error_flow < 0.5 * error_average, (error_flow, error_average)


def test_identical_frames_give_the_same_frame() -> None:
    frame = with_square(textured_background(40, 56), x=20)[None]
    np.testing.assert_array_equal(interpolate_midpoints(frame, frame), frame)


def test_deterministic() -> None:
    frames = moving_video(3)
    np.testing.assert_array_equal(interpolate_sequence(frames, 2), interpolate_sequence(frames, 2))


@pytest.mark.parametrize("shape", [(1, 1), (8, 8), (1, 40), (MIN_FLOW_SIZE - 1, 64), (40, 12)])
def test_small_frames_fall_back_to_the_average(shape: tuple[int, int]) -> None:
    frames_a, frames_b = random_frames(2, *shape, seed=1), random_frames(2, *shape, seed=2)
    expected = ((frames_a.astype(np.uint16) + frames_b + 1) // 2).astype(np.uint8)
    np.testing.assert_array_equal(interpolate_midpoints(frames_a, frames_b), expected)
    assert interpolate_sequence(frames_a, 2).shape == (5, *shape, 3)


@pytest.mark.parametrize("shape", [(MIN_FLOW_SIZE, MIN_FLOW_SIZE), (16, 200), (200, 16), (33, 47)])
def test_flow_works_at_any_size_from_the_threshold_up(shape: tuple[int, int]) -> None:
    frames_a, frames_b = random_frames(1, *shape, seed=3), random_frames(1, *shape, seed=4)
    assert interpolate_midpoints(frames_a, frames_b).shape == (1, *shape, 3)


@pytest.mark.parametrize("chunks", [[7], [1] * 7, [3, 4], [1, 2, 4], [2, 1, 1, 3], [6, 1]])
def test_streaming_equals_batch(chunks: list[int]) -> None:
    video = moving_video(sum(chunks))
    expected = interpolate_sequence(video, 2)

    interpolator = StreamingInterpolator(2)
    pieces = []
    start = 0
    for size in chunks:
        emitted = interpolator.push(video[start : start + size])
        start += size
        pieces.append(emitted)
        assert interpolator.frames_out == sum(len(piece) for piece in pieces)

    assert len(pieces[0]) == 1 + (chunks[0] - 1) * 4  # frame 0, then 3 inserted + 1 original per further frame
    np.testing.assert_array_equal(np.concatenate(pieces), expected)


def test_streaming_exp_zero_passes_frames_through() -> None:
    video = moving_video(4)
    interpolator = StreamingInterpolator(0)
    out = np.concatenate([interpolator.push(video[:1]), interpolator.push(video[1:])])
    np.testing.assert_array_equal(out, video)
    assert interpolator.frames_out == 4


def test_streaming_rejects_a_size_change() -> None:
    interpolator = StreamingInterpolator(1)
    interpolator.push(random_frames(2, 20, 30))
    with pytest.raises(ValueError, match="frames"):
        interpolator.push(random_frames(2, 20, 31))


@pytest.mark.parametrize("exp", [-1, 5, 1.5, True, "2"])
def test_bad_exp_is_named(exp) -> None:
    frames = random_frames(2, 8, 8)
    with pytest.raises(ValueError, match=r"exp: .* use an integer from 0"):
        interpolate_sequence(frames, exp)
    with pytest.raises(ValueError, match="exp"):
        StreamingInterpolator(exp)
    with pytest.raises(ValueError, match="exp"):
        output_frame_count(3, exp)


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        (np.zeros((8, 8, 3), np.uint8), "dimensions"),
        (np.zeros((2, 8, 8, 3), np.float32), "uint8"),
        (np.zeros((2, 8, 8, 4), np.uint8), "channels"),
        (np.zeros((2, 8, 8), np.uint8), "dimensions"),
        (np.zeros((0, 8, 8, 3), np.uint8), "at least one frame"),
        ([[[[0, 0, 0]]]], "numpy array"),
    ],
)
def test_bad_frames_are_named(frames, words: str) -> None:
    with pytest.raises(ValueError, match=rf"^frames: .*{words}"):
        interpolate_sequence(frames, 1)


def test_bad_pairs_are_named() -> None:
    good = random_frames(2, 8, 8)
    with pytest.raises(ValueError, match="^frames_a: .*uint8"):
        interpolate_midpoints(good.astype(np.int16), good)
    with pytest.raises(ValueError, match="^frames_b: .*channels"):
        interpolate_midpoints(good, good[..., :2])
    with pytest.raises(ValueError, match="^frames_b: .*does not match frames_a"):
        interpolate_midpoints(good, good[:1])
    with pytest.raises(ValueError, match="^frames: .*uint8"):
        StreamingInterpolator(1).push(good.astype(np.float64))


def test_output_frame_count() -> None:
    assert output_frame_count(1, 4) == 1
    assert output_frame_count(81, 1) == 161
    assert output_frame_count(5, 3) == 33
    with pytest.raises(ValueError, match="num_frames"):
        output_frame_count(0, 1)
