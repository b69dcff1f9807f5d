"""Learned frame interpolation: an IFNet that loads the published RIFE v4.x `flownet.pkl` weights unchanged.

RIFE (Huang et al., ECCV 2022; https://github.com/hzwer/Practical-RIFE) estimates the two flows from the unknown
middle frame back to both neighbours directly, coarse to fine, with a cascade of IFBlocks. Each block sees the
images (and, from v4.7 on, a small learned feature map of each image) warped by the flow so far, works at a fraction
of the resolution, and returns a flow correction, a blend-mask logit and 8 feature channels handed to the next
block. The result is the two backward-warped neighbours blended by the sigmoid of the last mask.

The module and parameter names here follow the published checkpoints, so their state dicts load without renaming:
`block{i}.conv0` (two stride-2 convs), `block{i}.convblock` (8 residual convs with a learned per-channel gain
`beta`), `block{i}.lastconv` (transposed conv + pixel shuffle), and `encode.cnn0`..`cnn3` (the feature encoder).
Two layouts are known: v4.22.lite (4 blocks) and v4.25 (5 blocks, one octave coarser to start); `load_rife` picks
one from the keys and checks every key and shape against it before loading anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from interp_svc.interpolate import MidpointFn, StreamingInterpolator, _check_frames, interpolate_sequence

logger = logging.getLogger(__name__)

SUPPORTED_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Flow-resolution factors accepted by `IFNet.interpolate` (0.5 for 4K input, as in the published inference).

Other values would make the per-block resampling factors non-dyadic, and the coarse-to-fine feature maps would no
longer line up with the padded frame.
"""

BLOCK_OUTPUT_CHANNELS = 13
"""Per-pixel output of every IFBlock: flow correction (4), mask logit (1), features for the next block (8)."""

TRAINING_ONLY_PREFIXES = ("teacher.", "caltime.")
"""Modules that some published checkpoints may carry but that only training uses (the distillation teacher block
and the time-calibration head). They are dropped, by name, before the key check; anything else unknown is an error.
"""

CHECKPOINT_PREFIX = "module."
"""Prefix that DistributedDataParallel put before every key of the published checkpoints."""


@dataclass(frozen=True)
class IFNetConfig:
    """Shape of one published IFNet layout.

    Attributes:
        name: release name, used in messages.
        block_channels: width `c` of each IFBlock, coarsest first; block i runs at 1 / 2**(n-1-i) of the frame.
        encoder_channels: channels of the learned feature map of each frame (the `encode` head's output).
        encoder_width: hidden width of the `encode` head.
    """

    name: str
    block_channels: tuple[int, ...]
    encoder_channels: int = 4
    encoder_width: int = 16

    @property
    def first_block_in_channels(self) -> int:
        """Both images (6), the timestep plane (1) and both feature maps."""
        return 7 + 2 * self.encoder_channels

    @property
    def refine_block_in_channels(self) -> int:
        """Both warped images (6), both warped feature maps, timestep (1), mask (1), carried features, flow (4)."""
        return 6 + 2 * self.encoder_channels + 1 + 1 + (BLOCK_OUTPUT_CHANNELS - 5) + 4

    @property
    def coarsest_scale(self) -> int:
        """Downsampling factor of the first block at scale 1.0: 2**(number of blocks - 1)."""
        return 2 ** (len(self.block_channels) - 1)


RIFE_4_22_LITE = IFNetConfig(name="4.22.lite", block_channels=(192, 128, 64, 32))
RIFE_4_25 = IFNetConfig(name="4.25", block_channels=(192, 128, 96, 64, 32))
LAYOUTS: dict[str, IFNetConfig] = {config.name: config for config in (RIFE_4_22_LITE, RIFE_4_25)}


def _conv_lrelu(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    """3x3 conv + LeakyReLU(0.2); a Sequential so that parameter names end in `.0.weight` like the checkpoints."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=True),
        nn.LeakyReLU(0.2),
    )


class FeatureEncoder(nn.Module):
    """Per-frame learned features at full resolution (`encode` in the checkpoints): down 2x, two convs, up 2x."""

    def __init__(self, out_channels: int = 4, width: int = 16) -> None:
        super().__init__()
        self.cnn0 = nn.Conv2d(3, width, kernel_size=3, stride=2, padding=1)
        self.cnn1 = nn.Conv2d(width, width, kernel_size=3, stride=1, padding=1)
        self.cnn2 = nn.Conv2d(width, width, kernel_size=3, stride=1, padding=1)
        self.cnn3 = nn.ConvTranspose2d(width, out_channels, kernel_size=4, stride=2, padding=1)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.cnn0(image))
        hidden = self.act(self.cnn1(hidden))
        hidden = self.act(self.cnn2(hidden))
        return self.cnn3(hidden)


class ResConv(nn.Module):
    """Residual 3x3 conv whose branch is scaled per channel by a learned `beta` (initialised to 1)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)
        self.beta = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.act = nn.LeakyReLU(0.2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(hidden) * self.beta + hidden)


class IFBlock(nn.Module):
    """One level of the cascade: resample the inputs by 1/scale, estimate at 1/4 of that, return full-size outputs.

    Returns the flow (or flow correction) in pixels of the full-size frame, the mask logit and 8 feature channels.
    """

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Sequential(
            _conv_lrelu(in_channels, channels // 2, stride=2),
            _conv_lrelu(channels // 2, channels, stride=2),
        )
        self.convblock = nn.Sequential(*(ResConv(channels) for _ in range(8)))
        # 4 * 13 channels at 1/2 of the working size, rearranged to 13 channels at the working size.
        self.lastconv = nn.Sequential(
            nn.ConvTranspose2d(channels, 4 * BLOCK_OUTPUT_CHANNELS, kernel_size=4, stride=2, padding=1),
            nn.PixelShuffle(2),
        )

    def forward(
        self, inputs: torch.Tensor, flow: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = F.interpolate(inputs, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            # Flow is in pixels, so it shrinks with the image.
            small_flow = F.interpolate(flow, scale_factor=1.0 / scale, mode="bilinear", align_corners=False) / scale
            hidden = torch.cat([hidden, small_flow], dim=1)
        hidden = self.conv0(hidden)
        hidden = self.convblock(hidden)
        out = self.lastconv(hidden)
        out = F.interpolate(out, scale_factor=scale, mode="bilinear", align_corners=False)
        return out[:, :4] * scale, out[:, 4:5], out[:, 5:]


class IFNet(nn.Module):
    """RIFE v4.x intermediate-flow network (4.22.lite layout by default; see `LAYOUTS`)."""

    def __init__(self, config: IFNetConfig = RIFE_4_22_LITE) -> None:
        super().__init__()
        self.config = config
        for index, channels in enumerate(config.block_channels):
            in_channels = config.first_block_in_channels if index == 0 else config.refine_block_in_channels
            self.add_module(f"block{index}", IFBlock(in_channels, channels))
        self.encode = FeatureEncoder(config.encoder_channels, config.encoder_width)

    @property
    def blocks(self) -> list[IFBlock]:
        return [getattr(self, f"block{index}") for index in range(len(self.config.block_channels))]

    def padding_multiple(self, scale: float = 1.0) -> int:
        """Height and width must be multiples of this: the coarsest block works at 1/(4 * its factor) of the frame."""
        base = 4 * self.config.coarsest_scale
        return max(base, int(base / scale))

    def forward(
        self, img0: torch.Tensor, img1: torch.Tensor, timestep: float | torch.Tensor = 0.5, scale: float = 1.0
    ) -> torch.Tensor:
        return self.interpolate(img0, img1, timestep=timestep, scale=scale)

    def interpolate(
        self, img0: torch.Tensor, img1: torch.Tensor, timestep: float | torch.Tensor = 0.5, scale: float = 1.0
    ) -> torch.Tensor:
        """The frame at `timestep` between img0 (t=0) and img1 (t=1), for a whole batch of pairs at once.

        Args:
            img0: float [N, 3, H, W] in [0, 1], the earlier frame of each pair.
            img1: float [N, 3, H, W] in [0, 1], the later frame of each pair.
            timestep: a float in [0, 1] for every pair, or a tensor [N] with one per pair.
            scale: flow resolution relative to the frame, one of SUPPORTED_SCALES (0.5 for 4K, 2.0 for tiny input).

        Returns:
            float [N, 3, H, W] in [0, 1]. Frames are zero-padded on the bottom and right up to
            `padding_multiple(scale)` as the published inference does, and cropped back.
        """
        if img0.ndim != 4 or img0.shape[1] != 3:
            raise ValueError(f"img0: shape {list(img0.shape)} is not allowed; expected [N, 3, H, W]")
        if img1.shape != img0.shape:
            raise ValueError(f"img1: shape {list(img1.shape)} does not match img0 {list(img0.shape)}")
        if scale not in SUPPORTED_SCALES:
            raise ValueError(f"scale: {scale!r} is not allowed; use one of {list(SUPPORTED_SCALES)}")

        batch, _, height, width = img0.shape
        multiple = self.padding_multiple(scale)
        pad_h = -height % multiple
        pad_w = -width % multiple
        img0 = F.pad(img0, (0, pad_w, 0, pad_h))
        img1 = F.pad(img1, (0, pad_w, 0, pad_h))
        padded_h, padded_w = height + pad_h, width + pad_w

        time_plane = self._time_plane(timestep, batch, padded_h, padded_w, img0)
        grid = _base_grid(batch, padded_h, padded_w, img0)
        # Both frames through the encoder as one batch.
        feat0, feat1 = self.encode(torch.cat([img0, img1], dim=0)).chunk(2, dim=0)

        scales = [self.config.coarsest_scale / 2**index / scale for index in range(len(self.config.block_channels))]
        flow: torch.Tensor | None = None
        mask = carried = warped0 = warped1 = None
        for block, block_scale in zip(self.blocks, scales, strict=True):
            if flow is None:
                flow, mask, carried = block(torch.cat([img0, img1, feat0, feat1, time_plane], dim=1), None, block_scale)
            else:
                warped_feat0 = _backward_warp(feat0, flow[:, :2], grid)
                warped_feat1 = _backward_warp(feat1, flow[:, 2:4], grid)
                inputs = torch.cat([warped0, warped1, warped_feat0, warped_feat1, time_plane, mask, carried], dim=1)
                delta, mask, carried = block(inputs, flow, block_scale)
                flow = flow + delta
            # flow[:, :2] points from the middle frame into img0, flow[:, 2:4] into img1.
            warped0 = _backward_warp(img0, flow[:, :2], grid)
            warped1 = _backward_warp(img1, flow[:, 2:4], grid)

        weight0 = torch.sigmoid(mask)
        merged = warped0 * weight0 + warped1 * (1 - weight0)
        return merged[:, :, :height, :width].clamp(0.0, 1.0)

    @staticmethod
    def _time_plane(
        timestep: float | torch.Tensor, batch: int, height: int, width: int, like: torch.Tensor
    ) -> torch.Tensor:
        """[N, 1, H, W] filled with each pair's timestep: the network takes time as an input channel."""
        if isinstance(timestep, torch.Tensor):
            values = timestep.to(device=like.device, dtype=like.dtype).reshape(-1)
            if values.numel() == 1:
                values = values.expand(batch)
            if values.numel() != batch:
                raise ValueError(f"timestep: {values.numel()} values for {batch} pairs; pass one float or one per pair")
        else:
            values = torch.full((batch,), float(timestep), device=like.device, dtype=like.dtype)
        return values.view(batch, 1, 1, 1).expand(batch, 1, height, width)


def _base_grid(batch: int, height: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """[N, H, W, 2] normalised (x, y) of every pixel centre, for grid_sample with align_corners=True."""
    ys = torch.linspace(-1.0, 1.0, height, device=like.device, dtype=like.dtype)
    xs = torch.linspace(-1.0, 1.0, width, device=like.device, dtype=like.dtype)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y], dim=-1).unsqueeze(0).expand(batch, height, width, 2)


def _backward_warp(image: torch.Tensor, flow: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """out(x) = image(x + flow(x)), flow in pixels; bilinear, border pixels repeated outside the frame."""
    height, width = image.shape[2:]
    # Pixels to the [-1, 1] range of align_corners=True, where the first and last pixel centres sit at -1 and 1.
    offset = torch.stack([flow[:, 0] / ((width - 1.0) / 2.0), flow[:, 1] / ((height - 1.0) / 2.0)], dim=-1)
    return F.grid_sample(image, grid + offset, mode="bilinear", padding_mode="border", align_corners=True)


def check_state_dict(state_dict: Mapping[str, torch.Tensor], model: IFNet, *, source: str = "state dict") -> None:
    """Raise ValueError naming every key the model lacks, every key it needs but is missing, and every shape that
    differs. Keys are named as in `state_dict`; missing ones with the prefix the other keys carry.
    """
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    prefix = CHECKPOINT_PREFIX if any(key.startswith(CHECKPOINT_PREFIX) for key in state_dict) else ""
    found: dict[str, str] = {}
    problems: list[str] = []
    unexpected: list[str] = []
    mis_shaped: list[str] = []
    for key, value in state_dict.items():
        name = key.removeprefix(CHECKPOINT_PREFIX)
        if name.startswith(TRAINING_ONLY_PREFIXES):
            continue
        if name in found:
            problems.append(f"duplicate key (with and without the prefix): {key!r}")
            continue
        found[name] = key
        if name not in expected:
            unexpected.append(key)
        elif not isinstance(value, torch.Tensor) or not value.is_floating_point():
            mis_shaped.append(f"{key} (not a floating-point tensor: {type(value).__name__})")
        elif tuple(value.shape) != expected[name]:
            mis_shaped.append(f"{key} {list(value.shape)} (expected {list(expected[name])})")
    missing = [prefix + name for name in expected if name not in found]

    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped keys: {', '.join(mis_shaped)}")
    if problems:
        raise ValueError(
            f"{source}: does not match the RIFE {model.config.name} IFNet layout "
            f"({len(expected)} tensors); " + "; ".join(problems)
        )


def detect_layout(state_dict: Mapping[str, torch.Tensor]) -> IFNetConfig:
    """The published layout a checkpoint was saved from: v4.25 has a fifth block, v4.22.lite has four."""
    names = {key.removeprefix(CHECKPOINT_PREFIX) for key in state_dict}
    return RIFE_4_25 if any(name.startswith("block4.") for name in names) else RIFE_4_22_LITE


def load_rife(
    path: str | PathLike[str],
    device: str | torch.device = "cpu",
    *,
    layout: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> IFNet:
    """Build an IFNet from a published `flownet.pkl` (4.22.lite or 4.25), in eval mode, without gradients.

    Every key and shape is checked before anything is loaded (see `check_state_dict`); the published loader's
    `strict=False` would silently run a half-random network when the file is from another version.

    Args:
        path: the checkpoint, a pickled state dict whose keys may carry the `module.` prefix.
        device: where the model runs.
        layout: a key of LAYOUTS; by default it is taken from the keys (`detect_layout`).
        dtype: parameter dtype (float16 halves memory on GPU; the published weights are float32).
    """
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, Mapping) or not all(isinstance(key, str) for key in loaded):
        raise ValueError(f"{path}: expected a state dict (a mapping of names to tensors), got {type(loaded).__name__}")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not known; use one of {sorted(LAYOUTS)}")
    config = LAYOUTS[layout] if layout is not None else detect_layout(loaded)

    model = IFNet(config)
    check_state_dict(loaded, model, source=str(path))
    dropped = sorted(key for key in loaded if key.removeprefix(CHECKPOINT_PREFIX).startswith(TRAINING_ONLY_PREFIXES))
    if dropped:
        logger.info("%s: dropped %d training-only tensors (%s)", path, len(dropped), ", ".join(TRAINING_ONLY_PREFIXES))
    state_dict = {
        key.removeprefix(CHECKPOINT_PREFIX): value
        for key, value in loaded.items()
        if not key.removeprefix(CHECKPOINT_PREFIX).startswith(TRAINING_ONLY_PREFIXES)
    }
    model.load_state_dict(state_dict, strict=True)
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


class RifeInterpolator:
    """uint8 frames in, uint8 midpoints out: the RIFE counterpart of `interpolate.interpolate_midpoints`.

    All pairs of a call go through the network as one batch (callers such as `StreamingInterpolator` already pass a
    whole chunk per call), so the GPU sees few large launches instead of many small ones.
    """

    def __init__(self, model: IFNet, scale: float = 1.0) -> None:
        if scale not in SUPPORTED_SCALES:
            raise ValueError(f"scale: {scale!r} is not allowed; use one of {list(SUPPORTED_SCALES)}")
        self.model = model
        self.scale = float(scale)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def midpoints(self, frames_a: np.ndarray, frames_b: np.ndarray) -> np.ndarray:
        """The frame half-way in time between frames_a[i] and frames_b[i], for every i.

        Args:
            frames_a: uint8 RGB frames [N, H, W, 3], the earlier frame of each pair.
            frames_b: uint8 RGB frames of the same shape, the later frame of each pair.

        Returns:
            uint8 RGB frames [N, H, W, 3], rounded to nearest.
        """
        _check_frames(frames_a, "frames_a")
        _check_frames(frames_b, "frames_b")
        if frames_a.shape != frames_b.shape:
            raise ValueError(
                f"frames_b: shape {list(frames_b.shape)} does not match frames_a {list(frames_a.shape)}; "
                "pass pairs of frames of the same shape"
            )
        if len(frames_a) == 0:
            return np.empty_like(frames_a)
        img0 = self._to_tensor(frames_a)
        img1 = self._to_tensor(frames_b)
        merged = self.model.interpolate(img0, img1, timestep=0.5, scale=self.scale)
        out = (merged.float() * 255.0).round_().clamp_(0, 255).to(torch.uint8)
        return out.permute(0, 2, 3, 1).contiguous().cpu().numpy()

    def interpolate_sequence(self, frames: np.ndarray, exp: int) -> np.ndarray:
        """Multiply the frame rate by 2**exp with recursive bisection, as `interpolate.interpolate_sequence`."""
        return interpolate_sequence(frames, exp, midpoint_fn=self.midpoints)

    def streaming(self, exp: int) -> StreamingInterpolator:
        """A chunk-by-chunk interpolator that inserts RIFE midpoints."""
        return StreamingInterpolator(exp, midpoint_fn=self.midpoints)

    def _to_tensor(self, frames: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(frames)).to(self.device)
        return tensor.permute(0, 3, 1, 2).to(self.dtype) / 255.0


class StreamingRifeInterpolator(StreamingInterpolator):
    """`StreamingInterpolator` with RIFE midpoints: `push` chunks, get every output frame as soon as it is known."""

    def __init__(self, exp: int, model: IFNet, scale: float = 1.0) -> None:
        self.rife = RifeInterpolator(model, scale)
        midpoint_fn: MidpointFn = self.rife.midpoints
        super().__init__(exp, midpoint_fn=midpoint_fn)
