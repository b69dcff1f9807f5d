"""Video frame interpolation without a learned model: optical flow, half-way warping, occlusion-aware blending.

Each inserted frame is the temporal midpoint of two neighbours. Dense optical flow is estimated both ways with
OpenCV's DIS algorithm, each neighbour is warped half-way towards the other, and the two warps are blended with
weights from a forward-backward consistency check, so that content one frame cannot see comes from the other.
Higher rates come from recursive bisection: `exp` rounds give 2**exp - 1 new frames between every pair.

Everything here is deterministic (DIS, remap and the blend do not depend on thread count or batch composition),
which is what lets `StreamingInterpolator` reproduce `interpolate_sequence` exactly, chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import cv2
import numpy as np

MAX_EXP = 4
"""Largest `exp` accepted: 2**4 = 16 times the frame rate."""

MIN_FLOW_SIZE = 16
"""Smallest height and width for which optical flow is estimated.

DIS needs at least one pyramid level whose smaller side holds a whole patch (8 px for the MEDIUM preset); OpenCV
raises below 12 px and, with the preset's default finest scale, can read out of bounds on frames 8-15 px high and
40 px or more wide. At 16 px every shape is safe. Smaller frames are interpolated as the plain average.
"""

FULL_RES_FLOW_MAX_PIXELS = 256 * 256
"""Frames with at most this many pixels get flow refined down to full resolution.

The MEDIUM preset stops at half resolution, which is fine for large frames but smears the motion of objects only a
few pixels wide on small ones. Refining to full resolution costs several times as much, so only small frames get it.
"""

# Forward-backward check (Sundaram et al., 2010): a flow vector is consistent when following it forward and the
# reverse flow back returns near the start, |w + w_back|^2 <= RELATIVE * (|w|^2 + |w_back|^2) + ABSOLUTE.
_CONSISTENCY_RELATIVE = 0.01
_CONSISTENCY_ABSOLUTE = 0.5

MidpointFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(frames_a, frames_b) -> midpoints, all uint8 [N, H, W, 3]: `interpolate_midpoints` or a learned model's."""


def output_frame_count(num_frames: int, exp: int) -> int:
    """Frames that `interpolate_sequence` returns for `num_frames` inputs: (num_frames - 1) * 2**exp + 1."""
    _check_exp(exp)
    if isinstance(num_frames, bool) or not isinstance(num_frames, int | np.integer) or num_frames < 1:
        raise ValueError(f"num_frames: {num_frames!r} is not allowed; use an integer >= 1")
    return (int(num_frames) - 1) * 2 ** int(exp) + 1


def interpolate_midpoints(frames_a: np.ndarray, frames_b: np.ndarray) -> np.ndarray:
    """The frame half-way in time between frames_a[i] and frames_b[i], for every i.

    Args:
        frames_a: uint8 RGB frames [N, H, W, 3], the earlier frame of each pair.
        frames_b: uint8 RGB frames of the same shape, the later frame of each pair.

    Returns:
        uint8 RGB frames [N, H, W, 3]. Frames smaller than MIN_FLOW_SIZE on either side are the plain average.
    """
    _check_frames(frames_a, "frames_a")
    _check_frames(frames_b, "frames_b")
    if frames_a.shape != frames_b.shape:
        raise ValueError(
            f"frames_b: shape {list(frames_b.shape)} does not match frames_a {list(frames_a.shape)}; "
            "pass pairs of frames of the same shape"
        )
    height, width = frames_a.shape[1:3]
    if min(height, width) < MIN_FLOW_SIZE:
        return _average(frames_a, frames_b)

    grid = _pixel_grid(height, width)
    midpoints = np.empty_like(frames_a)
    for i in range(len(frames_a)):
        midpoints[i] = _midpoint(frames_a[i], frames_b[i], grid)
    return midpoints


def interpolate_sequence(frames: np.ndarray, exp: int, midpoint_fn: MidpointFn | None = None) -> np.ndarray:
    """Multiply the frame rate by 2**exp: (F - 1) * 2**exp + 1 frames, the originals at every 2**exp-th index.

    Each round inserts the midpoint between every pair of neighbours (one batched `midpoint_fn` call),
    so a frame between two originals depends on those two originals only.

    Args:
        frames: uint8 RGB frames [F, H, W, 3] with F >= 1.
        exp: number of bisection rounds, 0 to MAX_EXP; 0 returns the frames unchanged.
        midpoint_fn: what computes the midpoints of a batch of pairs; `interpolate_midpoints` by default.
    """
    _check_exp(exp)
    _check_frames(frames, "frames")
    if len(frames) < 1:
        raise ValueError("frames: holds no frame; pass at least one frame [F >= 1, H, W, 3]")

    midpoint_fn = interpolate_midpoints if midpoint_fn is None else midpoint_fn
    sequence = frames.copy()
    for _ in range(exp):
        if len(sequence) < 2:
            break
        midpoints = midpoint_fn(sequence[:-1], sequence[1:])
        denser = np.empty((2 * len(sequence) - 1, *sequence.shape[1:]), dtype=np.uint8)
        denser[0::2] = sequence
        denser[1::2] = midpoints
        sequence = denser
    return sequence


class StreamingInterpolator:
    """Interpolates a video that arrives in chunks, emitting each output frame as soon as it is known.

    The first push emits frame 0, then, for every further frame, the frames inserted before it and the frame
    itself. The last frame seen stays as the left neighbour of the next chunk's first frame. Because a frame between
    two originals depends on those two only, the concatenation of all pushes equals `interpolate_sequence` of the
    whole video (exactly so for the default, deterministic midpoints; a learned `midpoint_fn` on a GPU may differ
    in the last bit with the batch size).
    """

    def __init__(self, exp: int, midpoint_fn: MidpointFn | None = None) -> None:
        _check_exp(exp)
        self.exp = int(exp)
        self.midpoint_fn = midpoint_fn
        self._last: np.ndarray | None = None
        self._frames_out = 0

    @property
    def frames_out(self) -> int:
        """Output frames emitted so far."""
        return self._frames_out

    def push(self, frames: np.ndarray) -> np.ndarray:
        """Take the next consecutive frames [n, H, W, 3] (n may be 1) and return the output frames now complete."""
        _check_frames(frames, "frames")
        if self._last is not None and frames.shape[1:3] != self._last.shape[:2]:
            raise ValueError(
                f"frames: {frames.shape[2]}x{frames.shape[1]} (WxH) frames follow "
                f"{self._last.shape[1]}x{self._last.shape[0]} frames; every chunk of a video must have one size"
            )
        if len(frames) == 0:
            return np.empty((0, *frames.shape[1:]), dtype=np.uint8)

        if self._last is None:
            emitted = interpolate_sequence(frames, self.exp, self.midpoint_fn)
        else:
            emitted = interpolate_sequence(np.concatenate([self._last[None], frames]), self.exp, self.midpoint_fn)[1:]
        self._last = frames[-1].copy()
        self._frames_out += len(emitted)
        return emitted


def _midpoint(frame_a: np.ndarray, frame_b: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The midpoint of one pair of [H, W, 3] frames.

    Backward warping (cv2.remap) needs, for each pixel x of the new frame, where to sample in frame a and in frame
    b, that is the flows from time 1/2 to a and to b, which are not measured. We approximate them with the measured
    flows at the same pixel: flow_{1/2->a}(x) ~ -flow_{a->b}(x) / 2 and flow_{1/2->b}(x) ~ -flow_{b->a}(x) / 2.
    This assumes the flow varies little over half a motion's length; DIS's densification spreads a moving object's
    flow over its surroundings, which keeps the approximation usable even for objects that move more than their
    own size.
    """
    if np.array_equal(frame_a, frame_b):
        return frame_a.copy()

    frame_a = np.ascontiguousarray(frame_a)
    frame_b = np.ascontiguousarray(frame_b)
    gray_a = cv2.cvtColor(frame_a, cv2.COLOR_RGB2GRAY)
    gray_b = cv2.cvtColor(frame_b, cv2.COLOR_RGB2GRAY)
    flow_ab = _dis_flow(gray_a, gray_b)
    flow_ba = _dis_flow(gray_b, gray_a)

    # 1 where a pixel is seen in both frames; 0 where it is occluded in (or leaves) the other frame.
    visible_a = _forward_backward_consistent(flow_ab, flow_ba, grid)
    visible_b = _forward_backward_consistent(flow_ba, flow_ab, grid)

    half_a = -0.5 * flow_ab
    half_b = -0.5 * flow_ba
    warped_a = _warp(frame_a.astype(np.float32), grid, half_a)
    warped_b = _warp(frame_b.astype(np.float32), grid, half_b)
    # What each warp brings to pixel x is occluded in the other frame where its source pixel failed the check.
    occluded_in_b = 1.0 - _warp(visible_a, grid, half_a)
    occluded_in_a = 1.0 - _warp(visible_b, grid, half_b)

    # Seen in both (or in neither): the average. Content hidden from b comes from a, content hidden from a from b.
    weight_a = 0.5 * (1.0 + occluded_in_b - occluded_in_a)
    midpoint = warped_b + weight_a[..., None] * (warped_a - warped_b)
    return np.clip(np.rint(midpoint), 0, 255).astype(np.uint8)


def _dis_flow(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Dense flow [H, W, 2] (x, y) from one grayscale frame to another: source(p) ~ target(p + flow(p)).

    A fresh DIS object per call: DIS rewrites its own patch size and scales for some frame sizes, and a shared
    object would make one pair's result depend on the pairs before it.
    """
    dis = cv2.DISOpticalFlow.create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
    if source.size <= FULL_RES_FLOW_MAX_PIXELS:
        dis.setFinestScale(0)
    return dis.calc(source, target, None)


def _forward_backward_consistent(flow_forward: np.ndarray, flow_backward: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """float32 [H, W]: 1 where following the flow forward and the reverse flow back returns near the start.

    Pixels that fail are occluded in the other frame (or badly matched); pixels whose flow leaves the frame count as
    failing, since the other frame cannot see them either.
    """
    height, width = flow_forward.shape[:2]
    back = _warp(flow_backward, grid, flow_forward)
    forward_x, forward_y = flow_forward[..., 0], flow_forward[..., 1]
    back_x, back_y = back[..., 0], back[..., 1]
    round_trip = (forward_x + back_x) ** 2 + (forward_y + back_y) ** 2
    magnitude = forward_x**2 + forward_y**2 + back_x**2 + back_y**2
    consistent = round_trip <= _CONSISTENCY_RELATIVE * magnitude + _CONSISTENCY_ABSOLUTE

    target = grid + flow_forward
    inside_x = (target[..., 0] >= 0) & (target[..., 0] <= width - 1)
    inside_y = (target[..., 1] >= 0) & (target[..., 1] <= height - 1)
    return (consistent & inside_x & inside_y).astype(np.float32)


def _warp(image: np.ndarray, grid: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """Backward warp: out(x) = image(x + flow(x)), bilinear, edges repeated."""
    coords = grid + flow
    return cv2.remap(image, coords[..., 0], coords[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def _pixel_grid(height: int, width: int) -> np.ndarray:
    """float32 [H, W, 2] holding each pixel's own (x, y)."""
    xs, ys = np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32))
    return np.stack([xs, ys], axis=-1)


def _average(frames_a: np.ndarray, frames_b: np.ndarray) -> np.ndarray:
    """Per-pixel mean, rounded half up."""
    return ((frames_a.astype(np.uint16) + frames_b + 1) // 2).astype(np.uint8)


def _check_exp(exp: int) -> None:
    if isinstance(exp, bool) or not isinstance(exp, int | np.integer) or not 0 <= exp <= MAX_EXP:
        raise ValueError(f"exp: {exp!r} is not allowed; use an integer from 0 (frames unchanged) to {MAX_EXP}")


def _check_frames(frames: np.ndarray, name: str) -> None:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array of uint8 frames [N, H, W, 3], got {type(frames).__name__}")
    if frames.ndim != 4:
        raise ValueError(f"{name}: {frames.ndim} dimensions are not allowed; expected 4, [N, H, W, 3]")
    if frames.dtype != np.uint8:
        raise ValueError(f"{name}: dtype {frames.dtype} is not allowed; expected uint8")
    if frames.shape[3] != 3:
        raise ValueError(f"{name}: {frames.shape[3]} channels are not allowed; expected 3 (RGB)")
    if frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"{name}: height and width must be at least 1, got {frames.shape[1]}x{frames.shape[2]}")
