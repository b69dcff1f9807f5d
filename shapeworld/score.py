"""Reading a video of the shape world: which shape, colour, motion and background it shows.

The reading uses the frames alone (numpy only, like shapeworld.world), never the prompt; `score` then compares
it with what the prompt asked.

- The object: every background is grey and every object colour saturated, so the object is the pixels whose
  chroma (max - min of R, G, B) is high. Frames where too little of it shows count as missing.
- Colour: the hue of the mean object pixel, nearest of the world's hues.
- Motion: least-squares fits of the object's centroid and log linear size over the clip. A size changing by more
  than GROWTH_RATIO is growing or shrinking, a centroid travelling more than TRAVEL of the frame moves along its
  larger component, else still; when both cross, the larger relative to its threshold decides.
- Shape: two blur-robust measures of the outline, each the median over the frames where the object is largest:
  the *taper*, its width a quarter of the way down over its width three quarters down (1 for a circle or a
  square, 1/3 for the triangle, apex up), and the *diagonal extent*, its extent along the diagonals over that
  along the axes (sqrt 2 for a square, 1 for a circle). A taper below TRIANGLE_TAPER is a triangle, else a
  diagonal extent above SQUARE_DIAGONAL a square, else a circle. Widths sum each pixel's coverage (its chroma
  over the object's); extents are where the coverage crosses one half.
- Background: the per-pixel median over time of the luminance where no object is; plain when nearly flat (dark,
  gray or light by its level), else striped when its variation is mostly between rows, else checkered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shapeworld.world import COLOURS, Concept, hue_of

CHROMA_THRESHOLD = 60  # levels; object pixels are above, grey background pixels far below
MIN_AREA = 0.002  # fraction of the frame: a frame with less object than this misses it
MIN_VISIBLE = 0.5  # fraction of frames that must show the object
GROWTH_RATIO = 1.6  # linear size end / start (or start / end) for growing (shrinking)
TRAVEL = 0.15  # fraction of the frame side the centroid must travel for a translation
TRIANGLE_TAPER = 0.7  # width a quarter of the way down / three quarters down, below which it is a triangle
SQUARE_DIAGONAL = 1.08  # diagonal / axis extent above which it is a square (a circle measures 1.00 +- 0.03)
TEXTURE_STD = 10.0  # grey levels: a background varying more than this is textured
DARK_BELOW, LIGHT_ABOVE = 70.0, 170.0  # grey level bounds of the plain backgrounds

ATTRIBUTES = ("shape", "colour", "motion", "background")


@dataclass(frozen=True)
class Reading:
    """What a video shows, with the measurements each attribute was decided from."""

    shape: str | None  # None where the object is missing
    colour: str | None
    motion: str | None
    background: str
    visible_frames: int
    hue: float | None = None
    taper: float | None = None
    diagonal: float | None = None
    travel: tuple[float, float] | None = None  # centroid displacement over the clip, fractions of (width, height)
    growth: float | None = None  # linear size at the end / at the start
    background_level: float = 0.0
    background_std: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_concept_dict(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in ATTRIBUTES}


def read_video(frames: np.ndarray) -> Reading:
    """Reads uint8 frames [F, H, W, 3]."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    num_frames, height, width, _ = frames.shape
    pixels = frames.astype(np.float32)
    chroma = pixels.max(axis=-1) - pixels.min(axis=-1)
    mask = chroma > CHROMA_THRESHOLD
    background, level, spread = _read_background(pixels, mask)

    areas = mask.reshape(num_frames, -1).sum(axis=1).astype(np.float64)
    visible = areas >= MIN_AREA * height * width
    if visible.sum() < max(2, math.ceil(MIN_VISIBLE * num_frames)):
        return Reading(None, None, None, background, int(visible.sum()), background_level=level, background_std=spread)

    object_pixels = pixels[mask]
    hue = hue_of(tuple(object_pixels.mean(axis=0)))
    colour = min(COLOURS, key=lambda name: _hue_distance(hue, hue_of(COLOURS[name])))

    t = np.linspace(0.0, 1.0, num_frames)[visible]
    ys, xs = np.mgrid[0:height, 0:width]
    centroid_x = np.array([xs[m].mean() for m in mask[visible]]) / width
    centroid_y = np.array([ys[m].mean() for m in mask[visible]]) / height
    travel = (_slope(t, centroid_x), _slope(t, centroid_y))
    growth = math.exp(_slope(t, 0.5 * np.log(areas[visible])))
    motion = _classify_motion(travel, growth)

    largest = areas[visible] >= np.median(areas[visible])
    outlines = np.array([_outline(c) for c in chroma[visible][largest]])
    taper, diagonal = (float(v) for v in np.median(outlines, axis=0))
    shape = "triangle" if taper < TRIANGLE_TAPER else "square" if diagonal > SQUARE_DIAGONAL else "circle"

    return Reading(
        shape=shape,
        colour=colour,
        motion=motion,
        background=background,
        visible_frames=int(visible.sum()),
        hue=round(hue, 1),
        taper=round(taper, 3),
        diagonal=round(diagonal, 3),
        travel=(round(travel[0], 3), round(travel[1], 3)),
        growth=round(growth, 3),
        background_level=round(level, 1),
        background_std=round(spread, 1),
    )


def score(reading: Reading, concept: Concept) -> dict[str, bool]:
    """Per attribute, whether the reading shows what `concept` asks for."""
    return {name: getattr(reading, name) == getattr(concept, name) for name in ATTRIBUTES}


def _classify_motion(travel: tuple[float, float], growth: float) -> str:
    dx, dy = travel
    moved = max(abs(dx), abs(dy)) / TRAVEL
    resized = abs(math.log(growth)) / math.log(GROWTH_RATIO)
    if moved < 1 and resized < 1:
        return "still"
    if resized >= moved:
        return "growing" if growth > 1 else "shrinking"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _read_background(pixels: np.ndarray, mask: np.ndarray) -> tuple[str, float, float]:
    """(name, mean grey level, spread) of the background, from the pixels no frame's object covers."""
    luminance = pixels @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    luminance = np.where(mask, np.nan, luminance)
    uncovered = ~mask.all(axis=0)
    image = np.full(luminance.shape[1:], np.nan, dtype=np.float32)
    image[uncovered] = np.nanmedian(luminance[:, uncovered], axis=0)
    level = float(np.nanmean(image))
    spread = float(np.nanstd(image))
    if spread < TEXTURE_STD:
        name = "dark" if level < DARK_BELOW else "light" if level > LIGHT_ABOVE else "gray"
        return name, level, spread
    centred = image - level
    row_variation = float(np.nanvar(np.nanmean(centred, axis=1)))
    return ("striped" if row_variation > 0.5 * spread**2 else "checkered"), level, spread


def _outline(chroma: np.ndarray) -> tuple[float, float]:
    """(taper, diagonal extent) of one frame's object; see the module docstring."""
    full = float(np.percentile(chroma[chroma > CHROMA_THRESHOLD], 90))
    coverage = np.clip(chroma / full, 0.0, 1.0)
    inside = coverage >= 0.5
    ys, xs = np.nonzero(inside)
    if len(ys) < 3:
        return 1.0, 1.0
    top, bottom = ys.min(), ys.max()
    height = bottom - top + 1
    widths = coverage.sum(axis=1)
    upper = widths[top + height // 4]
    lower = widths[top + (3 * height) // 4]
    taper = float(upper / lower) if lower > 0 else 1.0
    axes = 0.5 * ((xs.max() - xs.min() + 1) + height)
    diagonals = 0.5 * (np.ptp(xs + ys) + np.ptp(xs - ys)) / np.sqrt(2.0) + 1.0
    return taper, float(diagonals / axes)


def _slope(t: np.ndarray, values: np.ndarray) -> float:
    """Least-squares slope of values over t (t spans 0 to 1, so the slope is the change over the clip)."""
    centred = t - t.mean()
    denominator = float((centred * centred).sum())
    return 0.0 if denominator == 0 else float((centred * (values - values.mean())).sum() / denominator)


def _hue_distance(a: float, b: float) -> float:
    difference = abs(a - b) % 360.0
    return min(difference, 360.0 - difference)
