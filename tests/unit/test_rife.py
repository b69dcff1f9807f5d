"""RIFE IFNet: loads a checkpoint with exactly the published 4.22.lite keys and shapes, rejects any other, and
interpolates batches of odd-sized frames, alone and through the streaming bisection."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from interp_svc.interpolate import StreamingInterpolator, output_frame_count
from interp_svc.rife import IFNet, RifeInterpolator, StreamingRifeInterpolator, load_rife
from tests.helpers.rife_weights import published_shapes, random_state_dict

PUBLISHED_PARAMETERS = 4_866_052


def save(state_dict: dict[str, torch.Tensor], directory: Path) -> Path:
    path = directory / "flownet.pkl"
    torch.save(state_dict, path)
    return path


def random_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> IFNet:
    return load_rife(save(random_state_dict(), tmp_path_factory.mktemp("rife")), "cpu")


def test_published_layout_and_parameter_count() -> None:
    shapes = published_shapes()
    assert len(shapes) == 128
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == PUBLISHED_PARAMETERS

    ours = {f"module.{name}": tuple(tensor.shape) for name, tensor in IFNet().state_dict().items()}
    assert ours == shapes
    assert sum(parameter.numel() for parameter in IFNet().parameters()) == PUBLISHED_PARAMETERS


def test_load_takes_the_weights_unchanged(tmp_path: Path, model: IFNet) -> None:
    state_dict = random_state_dict()
    loaded = model.state_dict()
    for key, tensor in state_dict.items():
        torch.testing.assert_close(loaded[key.removeprefix("module.")], tensor, rtol=0, atol=0)
    assert not model.training
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_interpolate_odd_sized_batch(model: IFNet) -> None:
    generator = torch.Generator().manual_seed(1)
    img0 = torch.rand(2, 3, 37, 53, generator=generator)
    img1 = torch.roll(img0, shifts=(2, 3), dims=(2, 3))

    with torch.inference_mode():
        middle = model.interpolate(img0, img1, timestep=0.5)
        per_pair = model.interpolate(img0, img1, timestep=torch.tensor([0.25, 0.75]), scale=0.5)

    for out in (middle, per_pair):
        assert out.shape == (2, 3, 37, 53)
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()
        assert out.min() >= 0 and out.max() <= 1


def test_midpoints_of_uint8_frames(model: IFNet) -> None:
    frames_a, frames_b = random_frames(2, 37, 53, seed=1), random_frames(2, 37, 53, seed=2)
    midpoints = RifeInterpolator(model).midpoints(frames_a, frames_b)
    assert midpoints.shape == (2, 37, 53, 3)
    assert midpoints.dtype == np.uint8


@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_unsupported_scale_is_named(model: IFNet, scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        RifeInterpolator(model, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        model.interpolate(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8), scale=scale)


def broken(kind: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A state dict with one defect, and the keys the error must name."""
    state_dict = random_state_dict()
    if kind == "renamed":
        state_dict["module.block1.convblock.3.gamma"] = state_dict.pop("module.block1.convblock.3.beta")
        return state_dict, ["module.block1.convblock.3.gamma", "module.block1.convblock.3.beta"]
    if kind == "missing":
        del state_dict["module.encode.cnn2.bias"]
        return state_dict, ["module.encode.cnn2.bias"]
    if kind == "extra":
        state_dict["module.block3.refine.weight"] = torch.zeros(4, 4)
        return state_dict, ["module.block3.refine.weight"]
    if kind == "mis-shaped":
        state_dict["module.block2.lastconv.0.weight"] = torch.zeros(64, 56, 4, 4)
        return state_dict, ["module.block2.lastconv.0.weight"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["renamed", "missing", "extra", "mis-shaped"])
def test_bad_checkpoint_is_rejected_naming_the_key(tmp_path: Path, kind: str) -> None:
    state_dict, keys = broken(kind)
    with pytest.raises(ValueError) as error:
        load_rife(save(state_dict, tmp_path), "cpu")
    message = str(error.value)
    for key in keys:
        assert re.search(rf"{re.escape(key)}\b", message), (key, message)
    if kind == "mis-shaped":
        assert "[64, 56, 4, 4]" in message and "[64, 52, 4, 4]" in message


def test_every_defect_is_named_at_once(tmp_path: Path) -> None:
    state_dict = random_state_dict()
    del state_dict["module.block0.conv0.0.0.bias"]
    state_dict["module.block0.extra"] = torch.zeros(1)
    state_dict["module.encode.cnn3.weight"] = torch.zeros(16, 8, 4, 4)
    with pytest.raises(ValueError, match="missing.*block0.conv0.0.0.bias.*unexpected.*block0.extra.*encode.cnn3"):
        load_rife(save(state_dict, tmp_path), "cpu")


def test_keys_without_the_prefix_load_too(tmp_path: Path) -> None:
    state_dict = {key.removeprefix("module."): value for key, value in random_state_dict().items()}
    assert isinstance(load_rife(save(state_dict, tmp_path), "cpu"), IFNet)


def test_not_a_state_dict_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "flownet.pkl"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(ValueError, match="state dict"):
        load_rife(path, "cpu")


@pytest.mark.parametrize("chunks", [[5], [2, 1, 2], [1, 4]])
def test_streaming_bisection(model: IFNet, chunks: list[int]) -> None:
    video = random_frames(sum(chunks), 37, 53, seed=3)
    exp = 2

    for interpolator in (StreamingRifeInterpolator(exp, model), RifeInterpolator(model).streaming(exp)):
        assert isinstance(interpolator, StreamingInterpolator)
        pieces = []
        start = 0
        for size in chunks:
            pieces.append(interpolator.push(video[start : start + size]))
            start += size
        out = np.concatenate(pieces)

        assert len(out) == (len(video) - 1) * 4 + 1 == output_frame_count(len(video), exp)
        assert interpolator.frames_out == len(out)
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(out[:: 2**exp], video)

    # Chunking changes only the batch composition, so the result is the whole-video bisection (up to float rounding).
    whole = RifeInterpolator(model).interpolate_sequence(video, exp)
    assert np.abs(whole.astype(np.int16) - out).max() <= 1
