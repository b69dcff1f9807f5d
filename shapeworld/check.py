"""Reads a video of the shape world and says whether it shows what its prompt asked for.

    python -m shapeworld.check out/demo.mp4 --prompt "a red circle moving right on a dark background"
    python -m shapeworld.check out/demo.npz --prompt "..." --strip out/demo_strip.png

Prints one JSON object: what the prompt says, what the video shows (and the measurements behind it), and
per attribute whether they agree; exits 0 when every attribute agrees, 1 otherwise. `--strip` also writes
the frames side by side as a PNG (every `--every`-th, each enlarged `--scale` times, nearest neighbour).

Reads .npz (`frames`, as `stagediff generate` writes it) and .mp4 (decoded with PyAV) files; numpy, PyAV
and Pillow only, so it runs beside the client.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from shapeworld.score import read_video, score
from shapeworld.world import parse_prompt


def load_frames(path: Path) -> np.ndarray:
    """uint8 [F, H, W, 3] from an .npz (`frames`) or a video file PyAV decodes."""
    if path.suffix == ".npz":
        with np.load(path) as data:
            return np.asarray(data["frames"], dtype=np.uint8)
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def frame_strip(frames: np.ndarray, scale: int = 2, every: int = 1) -> np.ndarray:
    """Every `every`-th frame (the last one too) side by side, each enlarged `scale` times."""
    indices = sorted({*range(0, len(frames), every), len(frames) - 1})
    strip = np.concatenate([frames[i] for i in indices], axis=1)
    return strip.repeat(scale, axis=0).repeat(scale, axis=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("video", type=Path, help=".mp4 or .npz")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--strip", type=Path, help="also write the frames side by side to this PNG")
    parser.add_argument("--scale", type=int, default=2, help="enlargement of each frame in the strip")
    parser.add_argument("--every", type=int, default=1, help="put every n-th frame in the strip")
    args = parser.parse_args(argv)
    try:
        concept = parse_prompt(args.prompt)
    except ValueError as error:
        print(f"error: --prompt: {error}", file=sys.stderr)
        return 2
    frames = load_frames(args.video)
    reading = read_video(frames)
    agrees = score(reading, concept)
    if args.strip is not None:
        from PIL import Image

        args.strip.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(frame_strip(frames, args.scale, args.every)).save(args.strip)
    print(
        json.dumps(
            {
                "video": str(args.video),
                "frames": list(frames.shape),
                "asked": asdict(concept),
                "shows": {
                    **reading.as_concept_dict(),
                    "measured": {
                        "hue": reading.hue,
                        "taper": reading.taper,
                        "diagonal": reading.diagonal,
                        "travel": reading.travel,
                        "growth": reading.growth,
                        "background_level": reading.background_level,
                        "background_std": reading.background_std,
                    },
                },
                "agrees": agrees,
                "all_agree": all(agrees.values()),
            },
            default=lambda value: round(float(value), 4),  # the readings' numpy floats
        )
    )
    return 0 if all(agrees.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
