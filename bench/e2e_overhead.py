"""End-to-end latency of the cluster against in-process WanPipeline, side by side in one run.

Starts the local cluster on a checkpoint (the small preset by default), warms
both paths, then alternates: one request through the cluster, the same request
through `WanPipeline.__call__` in this process, N times. Every stage process and
the in-process pipeline get the same intra-op thread count (all cores: a single
request runs the stages one after another, so each may use the whole machine).
Prints one JSON object; `ratio` is the median cluster latency over the median
pipeline latency.

    python bench/e2e_overhead.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from stagediff import Client
from stagediff.local.supervisor import LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-bench-"))
    model = Path(args.model) if args.model else init_model("wan-t2v", args.preset, workdir / args.preset)
    request = dict(DEFAULT_REQUESTS[args.preset])
    prompt, negative = "a red fox running through fresh snow, cinematic", "blurry, low quality"

    torch.set_num_threads(args.threads)
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(model)

    def run_pipeline(seed: int) -> float:
        started = time.perf_counter()
        generator = torch.Generator("cpu").manual_seed(seed)
        pipeline(prompt=prompt, negative_prompt=negative, generator=generator, output_type="np", **request)
        return time.perf_counter() - started

    cluster = LocalCluster(model, threads_per_stage=args.threads, log_dir=workdir / "logs")
    cluster.start(timeout=600)
    try:
        with Client(cluster.endpoint) as client:

            def run_cluster(seed: int) -> tuple[float, dict[str, float]]:
                started = time.perf_counter()
                result = client.generate(prompt, negative_prompt=negative, seed=seed, **request)
                return time.perf_counter() - started, result.timings

            run_cluster(0)  # warm: first-call allocations, caches, lazy imports
            run_pipeline(0)
            cluster_s, pipeline_s, stage_timings = [], [], []
            for i in range(args.runs):
                seconds, timings = run_cluster(i + 1)
                cluster_s.append(seconds)
                stage_timings.append(timings)
                pipeline_s.append(run_pipeline(i + 1))
    finally:
        cluster.stop()

    median_cluster, median_pipeline = statistics.median(cluster_s), statistics.median(pipeline_s)
    print(
        json.dumps(
            {
                "benchmark": "e2e_overhead",
                "preset": args.preset,
                "request": request,
                "runs": args.runs,
                "threads": args.threads,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "cluster_s": [round(s, 3) for s in cluster_s],
                "pipeline_s": [round(s, 3) for s in pipeline_s],
                "median_cluster_s": round(median_cluster, 3),
                "median_pipeline_s": round(median_pipeline, 3),
                "ratio": round(median_cluster / median_pipeline, 3),
                "per_run_ratios": [round(c / p, 3) for c, p in zip(cluster_s, pipeline_s, strict=True)],
                "median_stage_s": {
                    stage: round(float(np.median([t.get(stage, 0.0) for t in stage_timings])), 3)
                    for stage in ("text-encoder", "dit", "vae", "total")
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
