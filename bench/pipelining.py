"""Pipelining across requests: N concurrent requests through the cluster against N in a row through WanPipeline.

Starts the local cluster on a checkpoint (by default the small preset's request, 17 frames and
8 steps, at 128x128: there the DiT and the VAE take about as long each) with one torch
thread per stage process, loads `WanPipeline.from_pretrained` on the same checkpoint in
this process with `torch.set_num_threads(<all cores>)`, and warms both with one request.
The warm-up request's stage times (DiT and VAE, as the cluster reports them) and the
pipeline's warm-up time are printed as `single_request`: the configuration is chosen so
that the DiT and VAE times are comparable, which is where overlapping them pays most.

Then, for each of `--rounds` rounds (the order of the two paths alternates from round to
round, so that noise from other processes on the machine hits both):
  - cluster: all N requests are sent at once (`AsyncClient.generate`, N in flight; the
    orchestrator runs with `--max-running-jobs N`, so none waits in its queue);
    wall time from the first send to the last result;
  - sequential: the same N requests (same prompts, seeds and sizes), one after another,
    through `WanPipeline.__call__(..., output_type="np")`.
Throughput is requests / wall seconds, summed over the rounds; `ratio` is cluster
throughput over sequential throughput (`per_round_ratios` gives each round's).

Fairness: both paths get the machine's cores. The cluster's four stage processes get one
intra-op thread each (on 2 cores the DiT and the VAE, the two that matter, each have a
core while they overlap); the pipeline gets all cores as torch threads, which is the
best a single in-process pipeline can do with them. Every request has its own prompt, so
the cluster's embedding cache does not spare its text encoder work the pipeline does.

Per-stage utilisation of the cluster, `busy seconds / wall seconds` of each cluster run:
each result carries `timings` (seconds per stage, measured by the orchestrator) and the
client records when the stage's last progress event of that job arrived. A job's
interval on a stage is [last event - timings[stage], last event]; the stage's busy
seconds are the length of the union of its jobs' intervals (a union, not a sum: the
orchestrator's DiT time of a job includes the time the job waits on the stage's single
compute thread behind another job, and a sum would count that twice). The text encoder
sends no progress events, so its busy seconds are the plain sum of its timings. A stage
at 1.0 was working for the whole wall time; the DiT and VAE both well above 0.5 means
they ran at the same time (the DiT denoising job k+1 while the VAE decodes job k).

    python bench/pipelining.py --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stagediff import AsyncClient
from stagediff.client import Event, Progress
from stagediff.init_model import DEFAULT_REQUESTS, init_model
from stagediff.local_cluster import LocalCluster

PROMPTS = (
    "a red fox running through fresh snow, cinematic",
    "a lighthouse in a storm at night",
    "waves on a pebble beach at sunset",
    "an astronaut floating inside a space station",
)
NEGATIVE_PROMPT = "blurry, low quality"
TIMED_STAGES = ("dit", "vae")  # stages that send progress events, whose intervals can be placed in time


def prompt_for(round_index: int, index: int) -> str:
    """A distinct prompt per request and round, so no embedding is served from the cluster's cache."""
    return f"{PROMPTS[index % len(PROMPTS)]}, take {round_index}-{index}"


@dataclass
class ClusterJob:
    """One request's stage timings and when its stages' last progress events reached the client."""

    timings: dict[str, float] = field(default_factory=dict)
    last_event_at: dict[str, float] = field(default_factory=dict)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def utilisation(jobs: list[ClusterJob], wall: float) -> dict[str, float]:
    """Busy seconds of each stage over the wall time (see the module docstring)."""
    busy = {
        stage: union_length([(job.last_event_at[stage] - job.timings[stage], job.last_event_at[stage]) for job in jobs])
        for stage in TIMED_STAGES
    }
    busy["text-encoder"] = sum(job.timings.get("text-encoder", 0.0) for job in jobs)
    return {stage: round(seconds / wall, 3) for stage, seconds in busy.items()}


async def run_cluster(
    endpoint: str, requests: list[tuple[str, int]], request: dict[str, Any]
) -> tuple[float, list[ClusterJob]]:
    """Sends every request at once; returns the wall seconds until the last result and each job's timings."""

    async def one(client: AsyncClient, prompt: str, seed: int) -> ClusterJob:
        job = ClusterJob()

        def on_progress(event: Event) -> None:
            if isinstance(event, Progress) and event.step == event.total:
                job.last_event_at[event.stage] = time.perf_counter()

        result = await client.generate(
            prompt, negative_prompt=NEGATIVE_PROMPT, seed=seed, on_progress=on_progress, **request
        )
        job.timings = dict(result.timings)
        return job

    async with AsyncClient(endpoint) as client:
        started = time.perf_counter()
        jobs = await asyncio.gather(*(one(client, prompt, seed) for prompt, seed in requests))
        wall = time.perf_counter() - started
    return wall, list(jobs)


def run_sequential(pipeline: Any, requests: list[tuple[str, int]], request: dict[str, Any]) -> float:
    """Runs the requests one after another through the in-process pipeline; returns the wall seconds."""
    started = time.perf_counter()
    for prompt, seed in requests:
        generator = torch.Generator("cpu").manual_seed(seed)
        pipeline(prompt=prompt, negative_prompt=NEGATIVE_PROMPT, generator=generator, output_type="np", **request)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint of --preset (default: make one with init-model)")
    parser.add_argument("--requests", type=int, default=8, help="requests per round (N)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the order of the two paths alternates")
    parser.add_argument("--height", type=int, default=128, help="0: the preset's")
    parser.add_argument("--width", type=int, default=128, help="0: the preset's")
    parser.add_argument("--frames", type=int, default=None, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="torch threads of the pipeline")
    args = parser.parse_args()
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-pipelining-"))
    model = Path(args.model) if args.model else init_model("wan-t2v", args.preset, workdir / args.preset)
    request = dict(DEFAULT_REQUESTS[args.preset])
    overrides = {
        "height": args.height,
        "width": args.width,
        "num_frames": args.frames,
        "num_inference_steps": args.steps,
    }
    request.update({key: value for key, value in overrides.items() if value})

    torch.set_num_threads(args.cores)
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    cluster = LocalCluster(
        model,
        threads_per_stage=1,
        log_dir=workdir / "logs",
        extra_args={"orchestrator": ["--max-running-jobs", str(args.requests)]},
    )
    cluster.start(timeout=600)
    cluster_s: list[float] = []
    sequential_s: list[float] = []
    utilisations: list[dict[str, float]] = []
    try:
        # Warm both (first-call allocations, lazy imports) and record one request's stage times.
        warm_wall, (warm_job,) = asyncio.run(run_cluster(cluster.endpoint, [(prompt_for(-1, 0), 0)], request))
        warm_pipeline = run_sequential(pipeline, [(prompt_for(-1, 1), 0)], request)
        for round_index in range(args.rounds):
            requests = [(prompt_for(round_index, i), 1 + round_index * args.requests + i) for i in range(args.requests)]
            order = ("cluster", "sequential") if round_index % 2 == 0 else ("sequential", "cluster")
            for path in order:
                if path == "cluster":
                    wall, jobs = asyncio.run(run_cluster(cluster.endpoint, requests, request))
                    cluster_s.append(wall)
                    utilisations.append(utilisation(jobs, wall))
                else:
                    sequential_s.append(run_sequential(pipeline, requests, request))
    finally:
        cluster.stop()

    total = args.requests * args.rounds
    cluster_rps, sequential_rps = total / sum(cluster_s), total / sum(sequential_s)
    print(
        json.dumps(
            {
                "benchmark": "pipelining",
                "preset": args.preset,
                "request": request,
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "cluster_threads_per_stage": 1,
                "sequential_threads": args.cores,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "single_request": {
                    "cluster_stage_s": {stage: round(seconds, 3) for stage, seconds in warm_job.timings.items()},
                    "cluster_wall_s": round(warm_wall, 3),
                    "sequential_s": round(warm_pipeline, 3),
                },
                "cluster_wall_s": [round(s, 3) for s in cluster_s],
                "sequential_wall_s": [round(s, 3) for s in sequential_s],
                "cluster_rps": round(cluster_rps, 4),
                "sequential_rps": round(sequential_rps, 4),
                "ratio": round(cluster_rps / sequential_rps, 3),
                "per_round_ratios": [round(s / c, 3) for c, s in zip(cluster_s, sequential_s, strict=True)],
                "cluster_utilisation": {
                    stage: round(statistics.fmean(u[stage] for u in utilisations), 3) for stage in utilisations[0]
                },
                "cluster_utilisation_per_round": utilisations,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
