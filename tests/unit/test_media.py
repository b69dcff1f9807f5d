"""Writing results: .npz and .png are exact, .mp4 is H.264 that decodes back close to the frames."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from stagediff import media
from stagediff.media import load_npz, read_video_frames, save_frames


def random_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)


def smooth_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    """Slowly varying colour gradients that drift over time: content a lossy codec keeps well."""
    ys, xs = np.mgrid[:height, :width].astype(np.float64)
    frames = []
    for t in range(num_frames):
        red = 128 + 90 * np.sin(xs / width * 2 * np.pi + 0.3 * t)
        green = 128 + 90 * np.cos(ys / height * 2 * np.pi - 0.2 * t)
        blue = 60 + 2 * (xs + ys) + 3 * t
        frames.append(np.stack([red, green, blue], axis=-1))
    return np.clip(np.rint(frames), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("fps", [16.0, 23.976])
def test_npz_round_trip_is_exact(tmp_path: Path, fps: float) -> None:
    frames = random_frames(5, 12, 20)
    path = save_frames(tmp_path / "nested" / "dir" / "out.npz", frames, fps)

    assert path == tmp_path / "nested" / "dir" / "out.npz"
    loaded, loaded_fps = load_npz(path)
    np.testing.assert_array_equal(loaded, frames)
    assert loaded.dtype == np.uint8
    assert loaded_fps == fps
    with np.load(path) as data:
        assert data["fps"].dtype == np.float64 and data["fps"].shape == ()


def test_upper_case_extension_keeps_the_name(tmp_path: Path) -> None:
    path = save_frames(tmp_path / "OUT.NPZ", random_frames(2, 4, 4), 8.0)
    assert path.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["OUT.NPZ"]
    np.testing.assert_array_equal(load_npz(path)[0], random_frames(2, 4, 4))


def test_png_round_trip_is_exact(tmp_path: Path) -> None:
    frame = random_frames(1, 17, 31)
    path = save_frames(tmp_path / "image.PNG", frame, 1.0)
    with Image.open(path) as image:
        assert image.format == "PNG"
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), frame[0])


def test_png_refuses_several_frames(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^frames: .*exactly one frame.*\.mp4 or \.npz"):
        save_frames(tmp_path / "image.png", random_frames(2, 8, 8), 1.0)
    assert not (tmp_path / "image.png").exists()


@pytest.mark.parametrize(("height", "width"), [(33, 47), (32, 48)])
def test_mp4_decodes_back_close(tmp_path: Path, height: int, width: int) -> None:
    frames = smooth_frames(9, height, width)
    path = save_frames(tmp_path / "video.mp4", frames, 12.0)

    decoded = read_video_frames(path)
    # yuv420p needs even sizes: an odd height or width gains one repeated edge row or column.
    padded = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    assert decoded.shape == padded.shape == (9, height + height % 2, width + width % 2, 3)
    assert decoded.dtype == np.uint8
    error = np.abs(decoded[:, :height, :width].astype(np.int16) - frames).mean()
    assert error < 8, error
    assert np.abs(decoded.astype(np.int16) - padded).mean() < 8

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.average_rate == 12


def test_mp4_keeps_a_fractional_rate(tmp_path: Path) -> None:
    path = save_frames(tmp_path / "ntsc.mp4", smooth_frames(6, 16, 16), 30000 / 1001)
    with av.open(str(path)) as container:
        assert container.streams.video[0].average_rate == Fraction(30000, 1001)
    assert len(read_video_frames(path)) == 6


def test_mp4_without_a_working_encoder_names_the_ones_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(media, "H264_ENCODERS", ("no_such_encoder", "another_missing_one"))
    with pytest.raises(RuntimeError, match="no_such_encoder, another_missing_one"):
        save_frames(tmp_path / "video.mp4", smooth_frames(2, 16, 16), 8.0)
    assert not (tmp_path / "video.mp4").exists()


def test_unknown_extension_lists_the_supported_ones(tmp_path: Path) -> None:
    for name in ("video.avi", "frames"):
        with pytest.raises(ValueError, match=r"^path: .*\.mp4, \.png, \.npz"):
            save_frames(tmp_path / name, random_frames(1, 8, 8), 8.0)


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        (np.zeros((2, 8, 8, 3), np.float32), "uint8"),
        (np.zeros((8, 8, 3), np.uint8), "shape"),
        (np.zeros((2, 8, 8, 4), np.uint8), "shape"),
        (np.zeros((0, 8, 8, 3), np.uint8), "at least 1"),
        ([[[[0, 0, 0]]]], "numpy array"),
    ],
)
def test_bad_frames_are_named(tmp_path: Path, frames, words: str) -> None:
    with pytest.raises(ValueError, match=rf"^frames: .*{words}"):
        save_frames(tmp_path / "out.npz", frames, 8.0)


@pytest.mark.parametrize("fps", [0, -1.0, float("nan"), float("inf"), "fast"])
def test_bad_fps_is_named(tmp_path: Path, fps) -> None:
    with pytest.raises(ValueError, match="^fps: "):
        save_frames(tmp_path / "out.npz", random_frames(1, 8, 8), fps)
