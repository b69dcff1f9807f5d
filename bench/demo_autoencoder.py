"""The quality the demo model's autoencoder allows: its round trip of real scenes, read as bench/demo_quality.py reads.

A generated video can only show what the VAE can decode, so the score of the VAE's own reconstructions of
rendered scenes is a ceiling on the score of the whole model, and the gap between the two is the DiT's.
For every case of `shapeworld.evaluation.evaluation_set()` this renders one scene of its concept (seeded
from the case's seed), reads it as rendered (the check of the check: every attribute must read right) and
as the VAE gives it back (encode, posterior mean, decode, with the library's own code), and prints one JSON
object with both summaries in the form bench/demo_quality.py prints, and every reconstruction that missed.

    python bench/demo_autoencoder.py                       # the committed checkpoint, seeds 0,1
    python bench/demo_autoencoder.py --model DIR --frames 9 --limit 12

Runs in-process on the CPU (no cluster: the VAE stage serves decoding only), one scene at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from shapeworld.evaluation import TARGET_ALL, evaluation_set, summarise
from shapeworld.score import read_video, score
from shapeworld.train_vae import reconstruct
from shapeworld.world import render, sample_scene

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "shapeworld" / "checkpoint"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a checkpoint with a vae/ folder")
    parser.add_argument("--seeds", default="0,1", help="scene seeds, comma-separated")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--limit", type=int, help="score only the first N cases (a quick look)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae").eval()
    cases = evaluation_set(seeds=[int(s) for s in args.seeds.split(",")])[: args.limit]
    started = time.perf_counter()
    rendered, reconstructed = [], []
    for index, case in enumerate(cases):
        scene = sample_scene(case.concept, np.random.default_rng([case.seed, index]))
        frames = render(scene, args.frames, args.size, args.size)
        rendered.append(score(read_video(frames), case.concept))
        reading = read_video(reconstruct(vae, frames))
        reconstructed.append((reading, score(reading, case.concept)))
    misses = [
        {
            "prompt": case.prompt,
            "split": case.split,
            "wrong": [n for n, ok in result.items() if not ok],
            "read": reading.as_concept_dict(),
        }
        for case, (reading, result) in zip(cases, reconstructed, strict=True)
        if not all(result.values())
    ]
    summary = summarise(cases, [result for _, result in reconstructed])
    print(
        json.dumps(
            {
                "benchmark": "demo_autoencoder",
                "model": str(args.model),
                "frames_shape": [args.frames, args.size, args.size, 3],
                "rendered": summarise(cases, rendered)["overall"],
                "reconstructed": summary["overall"],
                "reconstructed_per_split": summary["per_split"],
                "target_all": TARGET_ALL,
                "misses": misses,
                "wall_seconds": round(time.perf_counter() - started, 1),
                "machine": platform.processor() or platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
