"""The demo model's quality, read off its videos: does each show the shape, colour, motion and background asked for?

Generates every case of `shapeworld.evaluation.evaluation_set()` (prompts x seeds, a quarter each of seen
prompts, held-out phrasings, held-out combinations and both; the held-out lists are in shapeworld/world.py)
through a running cluster as raw frames, reads each video with `shapeworld.score.read_video` (the frames
alone, never the prompt) and scores the reading against the prompt. Prints one JSON object: the fraction
correct per attribute and for all attributes at once, overall and per split, the settings, and every video
that missed an attribute with what it showed.

    python bench/demo_quality.py                          # starts `stagediff up` on the demo checkpoint
    python bench/demo_quality.py --endpoint HOST:PORT     # a cluster already serving it
    python bench/demo_quality.py --steps 10 --seeds 0,1,2

Without --endpoint it starts the local cluster (deploy/docker-compose.cpu.yml, one torch thread per stage)
on `--model` (default: the committed checkpoint, shapeworld/checkpoint). Requests leave every field the
prompt does not set to the model's defaults (stagediff.json: 64x64, 17 frames, its step count and guidance)
unless --steps, --guidance, --frames are given. Deterministic for a given model, settings and seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shapeworld.evaluation import TARGET_ALL, Case, evaluation_set, summarise
from shapeworld.score import read_video, score
from stagediff.client import AsyncClient

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "shapeworld" / "checkpoint"


@contextlib.contextmanager
def cluster_endpoint(endpoint: str | None, model: Path) -> Iterator[str]:
    if endpoint:
        yield endpoint
        return
    from stagediff.local.supervisor import LocalCluster

    with LocalCluster(model, threads_per_stage=1) as local:
        yield local.endpoint


async def generate_all(endpoint: str, cases: list[Case], request: dict[str, Any], concurrency: int) -> list[Any]:
    limit = asyncio.Semaphore(concurrency)
    async with AsyncClient(endpoint) as client:

        async def one(case: Case) -> Any:
            async with limit:
                result = await client.generate(case.prompt, seed=case.seed, **request)
                return result.frames

        return await asyncio.gather(*(one(case) for case in cases))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="a cluster serving the demo model (default: start one)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--seeds", default="0,1", help="request seeds, comma-separated")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance", type=float, help="CFG scale (default: the model's)")
    parser.add_argument("--frames", type=int, help="frames per video (default: the model's)")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    cases = evaluation_set(seeds=[int(s) for s in args.seeds.split(",")])
    request = {
        name: value
        for name, value in (
            ("num_inference_steps", args.steps),
            ("guidance_scale", args.guidance),
            ("num_frames", args.frames),
        )
        if value is not None
    }
    started = time.perf_counter()
    with cluster_endpoint(args.endpoint, args.model) as endpoint:
        videos = asyncio.run(generate_all(endpoint, cases, request, args.concurrency))
    wall = time.perf_counter() - started
    readings = [read_video(frames) for frames in videos]
    scores = [score(reading, case.concept) for reading, case in zip(readings, cases, strict=True)]
    summary = summarise(cases, scores)
    misses = [
        {
            "prompt": case.prompt,
            "seed": case.seed,
            "split": case.split,
            "wrong": [name for name, ok in result.items() if not ok],
            "read": reading.as_concept_dict(),
            "measured": {
                "hue": reading.hue,
                "taper": reading.taper,
                "diagonal": reading.diagonal,
                "travel": reading.travel,
                "growth": reading.growth,
            },
        }
        for case, reading, result in zip(cases, readings, scores, strict=True)
        if not all(result.values())
    ]
    print(
        json.dumps(
            {
                "benchmark": "demo_quality",
                "model": str(args.model) if not args.endpoint else args.endpoint,
                "request": {**request, "seeds": args.seeds, "frames_shape": list(videos[0].shape)},
                **summary,
                "target_all": TARGET_ALL,
                "meets_target": summary["overall"]["all"] >= TARGET_ALL,
                "misses": misses,
                "wall_seconds": round(wall, 1),
                "machine": platform.processor() or platform.machine(),
            },
            indent=2,
            default=lambda value: round(float(value), 4),  # the readings' numpy floats
        )
    )


if __name__ == "__main__":
    main()
