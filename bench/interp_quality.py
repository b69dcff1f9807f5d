"""Frame-interpolation quality on synthetic video whose middle frame is known exactly.

Each clip is textured shapes over a textured background, moved by an analytic motion (translation, rotation about
the shape's centre, scaling about it, a camera pan, or all at once). Frames at t = 0, 0.5 and 1 are each rendered
from the same source textures with cv2.warpAffine at that time's transform, so the middle frame is ground truth,
not an interpolation. The interpolators under test see frames 0 and 1 and are scored by PSNR of their middle frame
against the truth, beside the plain blend (a + b) / 2 that any method must beat.

Prints one JSON object: PSNR per motion, per size, per motion and size, and overall (means over clips), and the gain
over the blend in dB.

    python bench/interp_quality.py
    python bench/interp_quality.py --rife path/to/flownet.pkl   # also score a RIFE checkpoint
    python bench/interp_quality.py --shape-world 24            # also the shape world, rendered and generated

With --shape-world N, two more sources at 64x64 and 17 frames, each scored on its odd frames from its even
ones (the interpolator sees frames 0, 2, ..., 16 and fills 1, 3, ..., 15): N clips rendered by the shape world
(shapeworld/world.py, whose odd frames are exact), and N videos the trained demo model generates for prompts of
its evaluation set (shapeworld/evaluation.py; its odd frames are what the model drew, the truth for this
purpose). For each it also reports the quality check's score (shapeworld/score.py) of the 17 frames that
interpolation rebuilds, beside that of the originals: whether interpolating changes what the video shows.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

from interp_svc.interpolate import interpolate_midpoints

MOTIONS = ("translate", "rotate", "scale", "pan", "mixed")
SIZES = ((256, 256), (480, 832))
TARGET_GAIN_DB = 3.0
"""The optical-flow interpolator should beat the plain blend by at least this much overall."""


@dataclass(frozen=True)
class Shape:
    """A textured sprite and its motion: frame(p) = centre(t) + R(angle * t) S(zoom ** t) (p - sprite centre)."""

    texture: np.ndarray  # float32 [h, w, 3]
    alpha: np.ndarray  # float32 [h, w], soft-edged coverage
    centre: tuple[float, float]  # (x, y) in the frame at t = 0
    velocity: tuple[float, float]  # (dx, dy) in pixels from t = 0 to t = 1
    angle: float  # degrees, counter-clockwise, from t = 0 to t = 1
    zoom: float  # scale factor from t = 0 to t = 1

    def transform(self, t: float) -> np.ndarray:
        """2x3 affine from sprite pixels to frame pixels at time t."""
        height, width = self.alpha.shape
        centre = (self.centre[0] + t * self.velocity[0], self.centre[1] + t * self.velocity[1])
        matrix = cv2.getRotationMatrix2D(((width - 1) / 2, (height - 1) / 2), self.angle * t, self.zoom**t)
        matrix[0, 2] += centre[0] - (width - 1) / 2
        matrix[1, 2] += centre[1] - (height - 1) / 2
        return matrix


@dataclass(frozen=True)
class Clip:
    motion: str
    height: int
    width: int
    background: np.ndarray  # float32 [H + 2 * margin, W + 2 * margin, 3]
    margin: int
    pan: tuple[float, float]  # camera motion in pixels from t = 0 to t = 1
    shapes: tuple[Shape, ...]

    def render(self, t: float) -> np.ndarray:
        """uint8 RGB frame [H, W, 3] at time t, every layer resampled once from its source texture."""
        # The camera moves by pan, so the background moves by -pan in the frame.
        shift = np.array(
            [[1, 0, -self.margin - t * self.pan[0]], [0, 1, -self.margin - t * self.pan[1]]], dtype=np.float64
        )
        frame = cv2.warpAffine(
            self.background, shift, (self.width, self.height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT
        )
        for shape in self.shapes:
            matrix = shape.transform(t)
            matrix[0, 2] -= t * self.pan[0]
            matrix[1, 2] -= t * self.pan[1]
            size = (self.width, self.height)
            sprite = cv2.warpAffine(shape.texture, matrix, size, flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
            alpha = cv2.warpAffine(shape.alpha, matrix, size, flags=cv2.INTER_LINEAR, borderValue=0.0)[..., None]
            frame = frame * (1 - alpha) + sprite * alpha
        return np.clip(np.rint(frame), 0, 255).astype(np.uint8)


def texture(height: int, width: int, rng: np.random.Generator, base: float, contrast: float) -> np.ndarray:
    """Colour noise summed over octaves (fine detail for the flow to match, coarse blotches for shading)."""
    out = np.zeros((height, width, 3), np.float32)
    for sigma, weight in ((0.8, 0.5), (2.5, 1.0), (8.0, 1.0), (24.0, 0.7)):
        noise = rng.normal(size=(height, width, 3)).astype(np.float32)
        noise = cv2.GaussianBlur(noise, (0, 0), sigma)
        out += weight * noise / (noise.std() + 1e-6)
    tint = rng.uniform(0.6, 1.0, size=3).astype(np.float32)
    return np.clip(base * tint + contrast * out / out.std(), 0, 255)


def sprite(size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A textured disc, rectangle or triangle of about size x size pixels, with an anti-aliased alpha."""
    pad = size // 2
    full = size + 2 * pad
    tex = texture(full, full, rng, base=rng.uniform(120, 200), contrast=45.0)
    # Stripes make the sprite clearly differ from the background and give rotation something to show.
    ys, xs = np.mgrid[:full, :full].astype(np.float32)
    stripes = 30 * np.sin((xs * math.cos(1.1) + ys * math.sin(1.1)) / rng.uniform(2.0, 5.0))
    tex = np.clip(tex + stripes[..., None], 0, 255)

    supersample = 4
    mask = np.zeros((full * supersample, full * supersample), np.uint8)
    lo, hi = pad * supersample, (pad + size) * supersample
    kind = rng.integers(3)
    if kind == 0:
        centre = (full * supersample) // 2
        cv2.circle(mask, (centre, centre), (hi - lo) // 2, 255, -1)
    elif kind == 1:
        cv2.rectangle(mask, (lo, lo + (hi - lo) // 5), (hi, hi - (hi - lo) // 5), 255, -1)
    else:
        cv2.fillPoly(mask, [np.array([[lo, hi], [(lo + hi) // 2, lo], [hi, hi]], np.int32)], 255)
    alpha = cv2.resize(mask, (full, full), interpolation=cv2.INTER_AREA).astype(np.float32) / 255
    return tex.astype(np.float32), alpha


def make_clip(motion: str, height: int, width: int, seed: int) -> Clip:
    """Motions sized relative to the frame: translations of 3-8 % of the width between the two input frames."""
    rng = np.random.default_rng(seed)
    unit = min(height, width)
    margin = int(0.1 * max(height, width)) + 8
    background = texture(height + 2 * margin, width + 2 * margin, rng, base=110.0, contrast=35.0)

    moves_objects = motion in ("translate", "mixed")
    rotates = motion in ("rotate", "mixed")
    scales = motion in ("scale", "mixed")
    pans = motion in ("pan", "mixed")

    shapes = []
    for _ in range(3 if unit < 400 else 4):
        size = int(rng.uniform(0.18, 0.3) * unit)
        tex, alpha = sprite(size, rng)
        centre = (rng.uniform(0.25, 0.75) * width, rng.uniform(0.25, 0.75) * height)
        if moves_objects:
            speed = rng.uniform(0.03, 0.08) * width
            direction = rng.uniform(0, 2 * math.pi)
            velocity = (speed * math.cos(direction), speed * math.sin(direction))
        else:
            velocity = (0.0, 0.0)
        angle = rng.choice([-1, 1]) * rng.uniform(8, 20) if rotates else 0.0
        zoom = float(rng.choice([rng.uniform(0.8, 0.9), rng.uniform(1.12, 1.25)])) if scales else 1.0
        shapes.append(Shape(tex, alpha, centre, velocity, float(angle), zoom))

    pan = (0.0, 0.0)
    if pans:
        speed = rng.uniform(0.02, 0.05) * width
        direction = rng.uniform(0, 2 * math.pi)
        pan = (speed * math.cos(direction), speed * math.sin(direction))
    return Clip(motion, height, width, background, margin, pan, tuple(shapes))


def psnr(estimate: np.ndarray, truth: np.ndarray) -> float:
    mse = float(np.mean((estimate.astype(np.float64) - truth.astype(np.float64)) ** 2))
    return 10 * math.log10(255.0**2 / max(mse, 1e-10))


def blend(frames_a: np.ndarray, frames_b: np.ndarray) -> np.ndarray:
    """The plain average (a + b) / 2, rounded half up: what interpolation without motion gives."""
    return ((frames_a.astype(np.uint16) + frames_b + 1) // 2).astype(np.uint8)


def summarise(rows: list[dict], methods: list[str], key: str | None) -> dict:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[key] if key else "all", []).append(row)
    out = {}
    for name, group in groups.items():
        entry = {f"{method}_psnr": round(float(np.mean([row[method] for row in group])), 2) for method in methods}
        for method in methods:
            if method != "blend":
                entry[f"{method}_gain_db"] = round(entry[f"{method}_psnr"] - entry["blend_psnr"], 2)
        entry["clips"] = len(group)
        out[name] = entry
    return out


def shape_world_videos(count: int) -> dict[str, tuple[list[np.ndarray], list]]:
    """17-frame 64x64 videos with their concepts: rendered by the world, and generated by the demo model."""
    import torch
    from diffusers import WanPipeline

    from shapeworld.demo_model import CHECKPOINT, DEFAULT_REQUEST
    from shapeworld.evaluation import evaluation_set
    from shapeworld.world import render, sample_scene

    cases = evaluation_set(seeds=(0,))[:count]
    rng = np.random.default_rng(0)
    rendered = [render(sample_scene(case.concept, rng), 17, 64, 64) for case in cases]
    pipeline = WanPipeline.from_pretrained(CHECKPOINT)
    pipeline.set_progress_bar_config(disable=True)
    generated = []
    for case in cases:
        frames = pipeline(
            prompt=case.prompt,
            **{**DEFAULT_REQUEST, "num_frames": 17},
            generator=torch.Generator("cpu").manual_seed(case.seed),
            output_type="np",
        ).frames[0]
        generated.append((np.clip(frames, 0, 1) * 255).round().astype(np.uint8))
    concepts = [case.concept for case in cases]
    return {"rendered": (rendered, concepts), "generated by the demo model": (generated, concepts)}


def score_shape_world(
    videos: list[np.ndarray], concepts: list, methods: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]]
) -> dict:
    """PSNR of each method's odd frames from the even ones, and the quality score before and after."""
    from shapeworld.score import read_video, score

    def correct(video: np.ndarray, concept: object) -> bool:
        return all(score(read_video(video), concept).values())

    report: dict = {"videos": len(videos), "quality_all_original": 0.0}
    for name, method in methods.items():
        values, kept = [], 0
        for video, concept in zip(videos, concepts, strict=True):
            even = video[::2]
            middles = method(even[:-1], even[1:])
            values.append(psnr(middles, video[1::2]))
            rebuilt = video.copy()
            rebuilt[1::2] = middles
            kept += correct(rebuilt, concept)
        report[f"{name}_psnr"] = round(float(np.mean(values)), 2)
        report[f"{name}_quality_all"] = round(kept / len(videos), 4)
    originals = sum(correct(video, concept) for video, concept in zip(videos, concepts, strict=True))
    report["quality_all_original"] = round(originals / len(videos), 4)
    for name in methods:
        if name != "blend":
            report[f"{name}_gain_db"] = round(report[f"{name}_psnr"] - report["blend_psnr"], 2)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=3, help="clips per motion and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rife", help="also score this RIFE flownet.pkl (4.22.lite or 4.25)")
    parser.add_argument("--device", default="cpu", help="device for --rife")
    parser.add_argument("--shape-world", type=int, default=0, metavar="N", help="also N shape-world clips of each kind")
    args = parser.parse_args()

    methods: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
        "blend": blend,
        "flow": interpolate_midpoints,
    }
    if args.rife:
        from interp_svc.rife import RifeInterpolator, load_rife

        methods["rife"] = RifeInterpolator(load_rife(args.rife, args.device)).midpoints

    rows = []
    seconds = dict.fromkeys(methods, 0.0)
    for height, width in SIZES:
        for motion_index, motion in enumerate(MOTIONS):
            for clip_index in range(args.clips):
                seed = args.seed + 1000 * motion_index + 100 * clip_index + height
                clip = make_clip(motion, height, width, seed)
                first, truth, last = (clip.render(t)[None] for t in (0.0, 0.5, 1.0))
                size = f"{height}x{width}"
                row = {"motion": motion, "size": size, "motion_size": f"{motion}@{size}", "seed": seed}
                for name, method in methods.items():
                    start = time.perf_counter()
                    middle = method(first, last)[0]
                    seconds[name] += time.perf_counter() - start
                    row[name] = psnr(middle, truth[0])
                rows.append(row)

    names = list(methods)
    overall = summarise(rows, names, None)["all"]
    report = {
        "benchmark": "interp_quality",
        "platform": platform.platform(),
        "clips": len(rows),
        "sizes": [f"{height}x{width}" for height, width in SIZES],
        "per_motion": summarise(rows, names, "motion"),
        "per_size": summarise(rows, names, "size"),
        "per_motion_and_size": summarise(rows, names, "motion_size"),
        "overall": overall,
        "seconds_per_midpoint": {name: round(total / len(rows), 4) for name, total in seconds.items()},
        "target_gain_db": TARGET_GAIN_DB,
        "target_met": overall["flow_gain_db"] >= TARGET_GAIN_DB,
    }
    if args.shape_world:
        report["shape_world"] = {
            source: score_shape_world(videos, concepts, methods)
            for source, (videos, concepts) in shape_world_videos(args.shape_world).items()
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
