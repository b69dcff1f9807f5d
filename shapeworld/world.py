"""The synthetic video world the demo model is trained on: one coloured shape, one motion, one background.

Everything is procedural and deterministic from a seed; no data files. A *concept* is what a prompt says; a
*scene* is one concrete video of it, drawn from a random generator; `render` turns a scene into uint8 frames.

    shapes       circle, square, triangle
    colours      red, yellow, green, cyan, blue, purple: saturated, six hues 50-70 degrees apart
    motions      moving left / right / up / down, growing, shrinking, standing still
    backgrounds  dark, gray, light (plain), checkered, striped (grey textures)

Every background is grey and every object colour saturated, which lets the quality check (shapeworld/score.py)
find the object in any frame without being told where. Motion is defined over the whole clip (t from 0 to 1), so
a 9-frame and a 17-frame video of one scene show the same path; sizes and positions are fractions of the frame,
so the world renders at any size (the model is trained at 64x64).

Prompts come from templates, several phrasings per concept. Some templates and (colour, shape, motion)
combinations are held out of training (`HELD_OUT_TEMPLATES`, `HELD_OUT_COMBINATIONS`), so that the quality check
measures whether the model composes what it learned rather than recalls a caption.
numpy only: the quality check runs beside the client, which never imports torch.
"""

from __future__ import annotations

import colorsys
import itertools
from dataclasses import dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle")

# sRGB of each object colour; a scene varies each channel by up to COLOUR_JITTER levels.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "yellow": (225, 205, 30),
    "green": (40, 175, 55),
    "cyan": (30, 195, 205),
    "blue": (45, 75, 225),
    "purple": (165, 50, 205),
}
COLOUR_JITTER = 12

MOTIONS = ("left", "right", "up", "down", "growing", "shrinking", "still")
# Unit direction (x right, y down, in image coordinates) of each translation.
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

# Grey levels (0-255) of each background: plain ones are one level, textured ones alternate two levels in
# cells (checkered) or rows (striped) of TEXTURE_PERIOD / 2 of the frame's shorter side (16 pixels at 64x64).
BACKGROUNDS: dict[str, tuple[int, int]] = {
    "dark": (28, 28),
    "gray": (120, 120),
    "light": (215, 215),
    "checkered": (70, 120),
    "striped": (150, 200),
}
TEXTURED = ("checkered", "striped")
TEXTURE_PERIOD = 32 / 64
BACKGROUND_JITTER = 8

# Object size: the half-extent of its bounding box, as a fraction of the frame's shorter side. Large, because a
# circle and a square of one size differ only at the square's corners: at 64x64 the autoencoder's latent grid
# is 8x8, and the corners of a smaller object cover too little of a latent pixel for the small DiT to learn
# the word that tells them apart (at 0.18-0.2 it drew one rounded square for both).
SIZE_RANGE = (0.25, 0.27)  # moving and still objects
GROWTH_RANGE = ((0.095, 0.105), (0.26, 0.28))  # growing: from the first range to the second; shrinking: reverse
TRAVEL_RANGE = (0.30, 0.32)  # how far a moving object goes over the clip, as a fraction of the frame
# Where the object is: the middle of its path lies within PLACEMENT of the frame's centre across the motion
# (on both axes for objects that do not move) and within ALONG_PLACEMENT of it along the motion. A narrow
# world: the demo model is small and trained in minutes, and a prompt's videos differ by a few pixels of place.
PLACEMENT = 0.15
ALONG_PLACEMENT = 0.05

# Words each concept may be said with; a prompt picks one phrase per slot.
MOTION_PHRASES: dict[str, tuple[str, ...]] = {
    "left": ("moving left", "moving to the left", "sliding left", "going left"),
    "right": ("moving right", "moving to the right", "sliding right", "going right"),
    "up": ("moving up", "moving upwards", "sliding up", "rising"),
    "down": ("moving down", "moving downwards", "sliding down", "falling"),
    "growing": ("growing", "getting bigger", "expanding"),
    "shrinking": ("shrinking", "getting smaller", "contracting"),
    "still": ("standing still", "not moving", "staying in place"),
}

TRAINING_TEMPLATES = (
    "a {colour} {shape} {motion} on a {background} background",
    "{colour} {shape} {motion}, {background} background",
    "a {shape}, {colour}, {motion} over a {background} background",
    "a {background} background with a {colour} {shape} {motion}",
    "video of a {colour} {shape} {motion} against a {background} background",
)
HELD_OUT_TEMPLATES = (
    "on a {background} background, a {colour} {shape} is {motion}",
    "there is a {colour} {shape} {motion} in front of a {background} background",
)

# (colour, shape, motion) never shown in training, on any background; every colour, shape and motion still
# appears in training with other partners. Two per colour, every shape and motion at least once.
HELD_OUT_COMBINATIONS: tuple[tuple[str, str, str], ...] = (
    ("red", "triangle", "up"),
    ("red", "square", "shrinking"),
    ("yellow", "circle", "down"),
    ("yellow", "triangle", "still"),
    ("green", "square", "left"),
    ("green", "circle", "growing"),
    ("cyan", "triangle", "right"),
    ("cyan", "square", "down"),
    ("blue", "circle", "still"),
    ("blue", "triangle", "shrinking"),
    ("purple", "square", "up"),
    ("purple", "circle", "left"),
)


@dataclass(frozen=True)
class Concept:
    """What a prompt says."""

    shape: str
    colour: str
    motion: str
    background: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.colour, tuple(COLOURS)),
            ("motion", self.motion, MOTIONS),
            ("background", self.background, tuple(BACKGROUNDS)),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not in the world; allowed: {', '.join(allowed)}")

    @property
    def held_out(self) -> bool:
        """Whether its (colour, shape, motion) is one of the combinations kept out of training."""
        return (self.colour, self.shape, self.motion) in HELD_OUT_COMBINATIONS

    def prompt(self, template: str, motion_phrase: int = 0) -> str:
        phrases = MOTION_PHRASES[self.motion]
        return template.format(
            colour=self.colour,
            shape=self.shape,
            motion=phrases[motion_phrase % len(phrases)],
            background=self.background,
        )


def parse_prompt(prompt: str) -> Concept:
    """The concept a prompt of the world says, by its words; ValueError naming what it does not say."""
    text = " ".join(prompt.lower().replace(",", " ").split())
    words = set(text.split())

    def one(kind: str, names: tuple[str, ...]) -> str:
        found = [name for name in names if name in words]
        if len(found) != 1:
            raise ValueError(f"the prompt must name one {kind} of {', '.join(names)}; it names {found or 'none'}")
        return found[0]

    motions = [motion for motion, phrases in MOTION_PHRASES.items() if any(f" {p} " in f" {text} " for p in phrases)]
    if len(motions) != 1:
        allowed = "; ".join(phrases[0] for phrases in MOTION_PHRASES.values())
        raise ValueError(f"the prompt must name one motion ({allowed}); it names {motions or 'none'}")
    return Concept(
        shape=one("shape", SHAPES),
        colour=one("colour", tuple(COLOURS)),
        motion=motions[0],
        background=one("background", tuple(BACKGROUNDS)),
    )


def all_concepts() -> list[Concept]:
    return [Concept(*values) for values in itertools.product(SHAPES, COLOURS, MOTIONS, BACKGROUNDS)]


def training_concepts() -> list[Concept]:
    """Every concept whose (colour, shape, motion) is not held out."""
    return [concept for concept in all_concepts() if not concept.held_out]


@dataclass(frozen=True)
class Scene:
    """One video of a concept. Positions are fractions of the frame (x from the left, y from the top)."""

    concept: Concept
    start: tuple[float, float]  # centre of the object's bounding box at t = 0
    end: tuple[float, float]  # ... and at t = 1
    size_start: float  # half-extent of the bounding box at t = 0, fraction of the shorter side
    size_end: float
    colour: tuple[int, int, int]  # the object's exact sRGB
    background: tuple[int, int]  # the background's exact grey levels
    texture_phase: tuple[float, float]  # offset of the texture, fraction of its period


def sample_scene(concept: Concept, rng: np.random.Generator) -> Scene:
    """A random scene of `concept`; the same generator state gives the same scene."""
    motion = concept.motion
    if motion in ("growing", "shrinking"):
        small, large = (rng.uniform(*GROWTH_RANGE[0]), rng.uniform(*GROWTH_RANGE[1]))
        size_start, size_end = (small, large) if motion == "growing" else (large, small)
    else:
        size_start = size_end = rng.uniform(*SIZE_RANGE)
    if motion in DIRECTIONS:
        dx, dy = DIRECTIONS[motion]
        travel = rng.uniform(*TRAVEL_RANGE)
        middle = 0.5 + rng.uniform(-ALONG_PLACEMENT, ALONG_PLACEMENT)
        across = 0.5 + rng.uniform(-PLACEMENT, PLACEMENT)
        begin, finish = middle - (dx + dy) * travel / 2, middle + (dx + dy) * travel / 2
        start, end = ((begin, across), (finish, across)) if dx else ((across, begin), (across, finish))
    else:
        start = end = (0.5 + rng.uniform(-PLACEMENT, PLACEMENT), 0.5 + rng.uniform(-PLACEMENT, PLACEMENT))
    base = np.array(COLOURS[concept.colour])
    colour = np.clip(base + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3), 0, 255)
    levels = np.clip(
        np.array(BACKGROUNDS[concept.background]) + rng.integers(-BACKGROUND_JITTER, BACKGROUND_JITTER + 1), 0, 255
    )
    return Scene(
        concept=concept,
        start=(float(start[0]), float(start[1])),
        end=(float(end[0]), float(end[1])),
        size_start=float(size_start),
        size_end=float(size_end),
        colour=(int(colour[0]), int(colour[1]), int(colour[2])),
        background=(int(levels[0]), int(levels[1])),
        texture_phase=(float(rng.uniform()), float(rng.uniform())),
    )


def render(scene: Scene, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 RGB frames [num_frames, height, width, 3] of `scene`, the object antialiased over its background."""
    background = _background(scene, height, width)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    side = float(min(height, width))
    colour = np.array(scene.colour, dtype=np.float32)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for index in range(num_frames):
        t = index / (num_frames - 1) if num_frames > 1 else 0.0
        cx = (scene.start[0] + t * (scene.end[0] - scene.start[0])) * width
        cy = (scene.start[1] + t * (scene.end[1] - scene.start[1])) * height
        half = (scene.size_start + t * (scene.size_end - scene.size_start)) * side
        coverage = _coverage(scene.concept.shape, xs - cx, ys - cy, half)[..., None]
        frames[index] = np.rint(background * (1 - coverage) + colour * coverage).astype(np.uint8)
    return frames


def _background(scene: Scene, height: int, width: int) -> np.ndarray:
    """float32 [height, width, 3] grey background."""
    low, high = scene.background
    period = TEXTURE_PERIOD * min(height, width)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    rows = np.floor(ys / (period / 2) + 2 * scene.texture_phase[1]).astype(np.int64) % 2
    columns = np.floor(xs / (period / 2) + 2 * scene.texture_phase[0]).astype(np.int64) % 2
    if scene.concept.background == "checkered":
        pattern = (rows + columns) % 2
    elif scene.concept.background == "striped":
        pattern = rows
    else:
        pattern = np.zeros_like(rows)
    grey = np.where(pattern == 1, high, low).astype(np.float32)
    return np.repeat(grey[..., None], 3, axis=-1)


def _coverage(shape: str, x: np.ndarray, y: np.ndarray, half: float) -> np.ndarray:
    """Fraction of each pixel inside the shape centred at (0, 0) with bounding-box half-extent `half`.

    From a signed distance (negative inside), clipped to one pixel of antialiasing: exact for the circle and
    the square, the largest distance to the edge lines for the triangle (exact inside and along its edges).
    """
    if shape == "circle":
        distance = np.sqrt(x * x + y * y) - half
    elif shape == "square":
        distance = np.maximum(np.abs(x), np.abs(y)) - half
    else:  # triangle, apex up: base 2 * half at y = +half, apex at y = -half
        # Edges: the base (y = half) and the two sides through the apex (0, -half) and (+-half, half).
        side_normal = np.array([2.0, -1.0]) / np.sqrt(5.0)  # outward normal of the right side
        right = np.abs(x) * side_normal[0] + (y + half) * side_normal[1]
        distance = np.maximum(y - half, right)
    return np.clip(0.5 - distance, 0.0, 1.0).astype(np.float32)


def hue_of(rgb: tuple[float, float, float]) -> float:
    """Hue in degrees [0, 360) of an sRGB colour (0-255)."""
    h, _, _ = colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))
    return 360.0 * h
