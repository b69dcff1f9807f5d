"""Per-stage times of an image-to-video request beside a text-to-video one, side by side in one run.

Starts two local clusters at once, one serving a `wan-t2v` checkpoint and one a `wan-i2v` checkpoint of
the same preset (the same DiT size; the I2V transformer takes 36 input channels and has image
cross-attention, and its text-encoder stage also runs CLIP vision), warms both, then alternates the same
request (prompt, size, frames, steps, seed) through each, the I2V one with an input image of another
size than the output. Each stage process gets all cores (a single request runs the stages one after
another). Prints one JSON object: every run's stage timings, their medians, and the ratio of each I2V
median to the T2V one. "vae-encode" (the VAE's Encode of the input frame) runs at the same time as the
text encoder, so it adds to "total" only where it takes longer.

    python bench/image_to_video.py --runs 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from stagediff import Client
from stagediff.local.supervisor import LocalCluster

STAGES = ("text-encoder", "vae-encode", "dit", "vae", "total")


def input_png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = np.clip(pixels + rng.normal(0, 20, pixels.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-bench-"))
    request = dict(DEFAULT_REQUESTS[args.preset])
    prompt, negative = "a red fox running through fresh snow, cinematic", "blurry, low quality"
    image = input_png(request["width"] * 3 // 2, request["height"])
    clusters = {
        family: LocalCluster(
            init_model(family, args.preset, workdir / family),
            threads_per_stage=args.threads,
            log_dir=workdir / f"logs-{family}",
        )
        for family in ("wan-t2v", "wan-i2v")
    }
    timings: dict[str, list[dict[str, float]]] = {family: [] for family in clusters}
    try:
        for cluster in clusters.values():
            cluster.start(timeout=600)
        clients = {family: Client(cluster.endpoint) for family, cluster in clusters.items()}

        def run(family: str, seed: int) -> dict[str, float]:
            extra = {"image": image} if family == "wan-i2v" else {}
            result = clients[family].generate(prompt, negative_prompt=negative, seed=seed, **request, **extra)
            return dict(result.timings)

        for family in clusters:
            run(family, 0)  # warm: first-call allocations, caches, lazy imports
        for i in range(args.runs):
            for family in clusters:
                timings[family].append(run(family, i + 1))
        for client in clients.values():
            client.close()
    finally:
        for cluster in clusters.values():
            cluster.stop()

    medians = {
        family: {stage: round(statistics.median(t.get(stage, 0.0) for t in runs), 3) for stage in STAGES}
        for family, runs in timings.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "image_to_video",
                "preset": args.preset,
                "request": request,
                "input_image": "PNG, 1.5x the output's width",
                "runs": args.runs,
                "threads": args.threads,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "timings_s": timings,
                "median_stage_s": medians,
                "i2v_over_t2v": {
                    stage: round(medians["wan-i2v"][stage] / medians["wan-t2v"][stage], 3)
                    for stage in STAGES
                    if medians["wan-t2v"][stage] > 0
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
