"""Pipelining across requests: N concurrent requests through the cluster against N in a row through WanPipeline.

Starts the local cluster on a checkpoint (by default the tiny preset at 64x64, 9 frames and
14 steps with CFG: there the cluster's DiT and VAE take about as long each, about 0.12 s,
and a single in-process pipeline gains less from a second torch thread than on the small
preset, about 1.25x against about 1.4x, the DiT almost nothing) with one torch thread per
stage process, loads `WanPipeline.from_pretrained` on the same checkpoint in this
process, and warms both with one request (the pipeline at each of its thread counts).

Then it times `--singles` single requests, one at a time, through each path and prints
the medians as `single_request_median`: the cluster's stage times (text encoder, DiT,
VAE, as the orchestrator reports them, 1 thread each) and its wall time, and the
pipeline's wall time at 1 thread and at all cores, split into text encoder, transformer
and VAE decode (the pipeline's modules timed in place). With the pipeline's time per
request from the rounds below (`sequential_s_per_request`: wall seconds / N at the
baseline's thread count, steadier than single requests):
  - `ceiling` = pipeline time per request / max(DiT, VAE): the most the cluster can gain
    with perfect overlap, when the slower of the two stages bounds its throughput;
  - `ceiling_on_cores` = pipeline time per request / max(max(DiT, VAE), (text encoder +
    DiT + VAE) / cores): the same, bounded as well by all the stages' work shared out over
    the cores (the text encoder needs a core too; the orchestrator's and gRPC's work is not
    counted);
  - `ceiling_with_fill_drain` = N x pipeline time per request / (N x max(DiT, VAE) + text
    encoder + min(DiT, VAE)): `ceiling` less the cost of filling and draining the
    two-stage pipeline for N requests.

Then, for each of `--rounds` rounds (the order of the paths reverses from round to round,
so that noise from other processes on the machine hits all of them):
  - cluster: all N requests are sent at once (`AsyncClient.generate`, N in flight; the
    orchestrator runs with `--max-running-jobs N`, so none waits in its queue);
    wall time from the first send to the last result;
  - sequential, at 1 torch thread and at all cores: the same N requests (same prompts,
    seeds, sizes, steps, CFG and negative prompt), one after another, through
    `WanPipeline.__call__(..., output_type="np")`.
Throughput is requests / wall seconds, summed over the rounds. `ratio` is cluster
throughput over the throughput of the better of the pipeline's two thread counts
(`baseline_threads`); `per_round_ratios` gives each round's, `ratio_vs_<t>_threads` the
ratio against each thread count.

Fairness: both paths get the machine's cores. The cluster's four stage processes get one
intra-op thread each (on 2 cores the DiT and the VAE, the two that matter, each have a
core while they overlap); the pipeline runs with 1 thread and with all cores as torch
threads, and the better of the two is the baseline: the best a single in-process pipeline
can do with these cores. Every request has its own prompt, so the cluster's embedding
cache does not spare its text encoder work the pipeline does.

Per-stage utilisation of the cluster, `busy seconds / wall seconds` of each cluster run:
each result carries `timings` (seconds per stage, measured by the orchestrator) and the
client records when the stage's last progress event of that job arrived. A job's
interval on a stage is [last event - timings[stage], last event]; the stage's busy
seconds are the length of the union of its jobs' intervals (a union, not a sum: the
orchestrator's DiT time of a job includes the time the job waits on the stage's single
compute thread behind another job, and a sum would count that twice). The text encoder
sends no progress events, so its busy seconds are the plain sum of its timings (which
include queueing when requests arrive together: an upper bound). A stage at 1.0 was
working for the whole wall time; the DiT and VAE both well above 0.5 means they ran at
the same time (the DiT denoising job k+1 while the VAE decodes job k).
`cluster_busy_s_per_job` is busy seconds / N: against the single-request stage times it
shows how much slower a stage ran while the others competed for the cores.

    python bench/pipelining.py
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from stagediff import AsyncClient
from stagediff.client import Event, Progress
from stagediff.local.supervisor import LocalCluster

PROMPTS = (
    "a red fox running through fresh snow, cinematic",
    "a lighthouse in a storm at night",
    "waves on a pebble beach at sunset",
    "an astronaut floating inside a space station",
)
NEGATIVE_PROMPT = "blurry, low quality"
TIMED_STAGES = ("dit", "vae")  # stages that send progress events, whose intervals can be placed in time
DEFAULT_PRESET = "tiny"
DEFAULT_SIZE = dict(height=64, width=64, num_frames=9, num_inference_steps=14)


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


def busy_seconds(jobs: list[ClusterJob]) -> dict[str, float]:
    """Seconds each stage was working during a cluster run (see the module docstring)."""
    busy = {
        stage: union_length([(job.last_event_at[stage] - job.timings[stage], job.last_event_at[stage]) for job in jobs])
        for stage in TIMED_STAGES
    }
    busy["text-encoder"] = sum(job.timings.get("text-encoder", 0.0) for job in jobs)
    return busy


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


class ComponentTimer:
    """Adds up the seconds the pipeline spends in its text encoder, transformer and VAE decode.

    Wraps the bound methods on the instances (the pipeline calls them as it always does), so one
    request's time through WanPipeline splits into the same parts as the cluster's stages.
    """

    def __init__(self, pipeline: Any) -> None:
        self.seconds: dict[str, float] = {}
        self._wrap(pipeline.text_encoder, "forward", "text-encoder")
        self._wrap(pipeline.transformer, "forward", "dit")
        self._wrap(pipeline.vae, "decode", "vae")

    def _wrap(self, module: Any, method: str, stage: str) -> None:
        inner: Callable[..., Any] = getattr(module, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

        setattr(module, method, timed)


def run_sequential(pipeline: Any, requests: list[tuple[str, int]], request: dict[str, Any], threads: int) -> float:
    """Runs the requests one after another through the in-process pipeline with `threads` torch threads;
    returns the wall seconds."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    for prompt, seed in requests:
        generator = torch.Generator("cpu").manual_seed(seed)
        pipeline(prompt=prompt, negative_prompt=NEGATIVE_PROMPT, generator=generator, output_type="np", **request)
    return time.perf_counter() - started


def median_dict(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(sample[key] for sample in samples), 4) for key in samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint of --preset (default: make one with init-model)")
    parser.add_argument("--requests", type=int, default=8, help="requests per round (N)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds; the order of the paths alternates")
    parser.add_argument("--singles", type=int, default=5, help="single requests per path timed after the warm-up")
    parser.add_argument("--height", type=int, default=DEFAULT_SIZE["height"], help="0: the preset's")
    parser.add_argument("--width", type=int, default=DEFAULT_SIZE["width"], help="0: the preset's")
    parser.add_argument("--frames", type=int, default=DEFAULT_SIZE["num_frames"], help="0: the preset's")
    parser.add_argument("--steps", type=int, default=DEFAULT_SIZE["num_inference_steps"], help="0: the preset's")
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="cores; the pipeline runs at 1 and at this many threads"
    )
    args = parser.parse_args()
    if args.requests < 1 or args.rounds < 1 or args.singles < 1:
        parser.error("--requests, --rounds and --singles must be at least 1")

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
    thread_counts = sorted({1, args.cores})

    torch.set_num_threads(args.cores)
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    timer = ComponentTimer(pipeline)
    cluster = LocalCluster(
        model,
        threads_per_stage=1,
        log_dir=workdir / "logs",
        extra_args={"orchestrator": ["--max-running-jobs", str(args.requests)]},
    )
    cluster.start(timeout=600)
    single_cluster: list[dict[str, float]] = []
    single_pipeline: dict[int, list[dict[str, float]]] = {threads: [] for threads in thread_counts}
    cluster_s: list[float] = []
    sequential_s: dict[int, list[float]] = {threads: [] for threads in thread_counts}
    busy: list[dict[str, float]] = []
    try:
        # Warm both (first-call allocations, lazy imports; the pipeline at each thread count), then time
        # single requests: the cluster's stage times, the pipeline's time and its split at each thread count.
        asyncio.run(run_cluster(cluster.endpoint, [(prompt_for(-1, 0), 0)], request))
        for threads in thread_counts:
            run_sequential(pipeline, [(prompt_for(-1, 1), 0)], request, threads)
        for index in range(args.singles):
            wall, (job,) = asyncio.run(run_cluster(cluster.endpoint, [(prompt_for(-2, index), index)], request))
            single_cluster.append({**job.timings, "wall": wall})
            for threads in thread_counts:
                timer.seconds.clear()
                wall = run_sequential(pipeline, [(prompt_for(-3, index), index)], request, threads)
                single_pipeline[threads].append({**timer.seconds, "wall": wall})
        paths = ["cluster", *thread_counts]
        for round_index in range(args.rounds):
            requests = [(prompt_for(round_index, i), 1 + round_index * args.requests + i) for i in range(args.requests)]
            for path in paths if round_index % 2 == 0 else reversed(paths):
                if path == "cluster":
                    wall, jobs = asyncio.run(run_cluster(cluster.endpoint, requests, request))
                    cluster_s.append(wall)
                    busy.append(busy_seconds(jobs))
                else:
                    sequential_s[path].append(run_sequential(pipeline, requests, request, path))
    finally:
        cluster.stop()

    total = args.requests * args.rounds
    best_threads = min(thread_counts, key=lambda threads: sum(sequential_s[threads]))
    cluster_rps = total / sum(cluster_s)
    sequential_rps = {threads: total / sum(seconds) for threads, seconds in sequential_s.items()}
    single = {
        "cluster_1_thread_per_stage_s": median_dict(single_cluster),
        **{f"pipeline_{threads}_threads_s": median_dict(single_pipeline[threads]) for threads in thread_counts},
    }
    stage_s = single["cluster_1_thread_per_stage_s"]
    bottleneck = max(stage_s["dit"], stage_s["vae"])
    # The stages' work per request shared out over the cores (each stage process has 1 thread).
    per_core = (stage_s.get("text-encoder", 0.0) + stage_s["dit"] + stage_s["vae"]) / args.cores
    # The pipeline's time per request: from the rounds (N requests in a row at the baseline's thread count), which
    # vary less than single requests do.
    best_single = sum(sequential_s[best_threads]) / total
    # Cluster time for N requests with perfect overlap: N bottleneck stage times, plus filling (text encoder,
    # the other stage's first job) and draining, about one pass of the non-bottleneck stages.
    fill_drain_s = stage_s.get("text-encoder", 0.0) + min(stage_s["dit"], stage_s["vae"])
    print(
        json.dumps(
            {
                "benchmark": "pipelining",
                "preset": args.preset,
                "request": request,
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "cluster_threads_per_stage": 1,
                "sequential_threads": thread_counts,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "single_request_median": single,
                "sequential_s_per_request": round(best_single, 4),
                "ceiling": round(best_single / bottleneck, 3),
                "ceiling_on_cores": round(best_single / max(bottleneck, per_core), 3),
                "ceiling_with_fill_drain": round(
                    args.requests * best_single / (args.requests * bottleneck + fill_drain_s), 3
                ),
                "cluster_wall_s": [round(s, 3) for s in cluster_s],
                **{
                    f"sequential_{threads}_threads_wall_s": [round(s, 3) for s in sequential_s[threads]]
                    for threads in thread_counts
                },
                "cluster_rps": round(cluster_rps, 4),
                **{f"sequential_{threads}_threads_rps": round(rps, 4) for threads, rps in sequential_rps.items()},
                "baseline_threads": best_threads,
                "ratio": round(cluster_rps / sequential_rps[best_threads], 3),
                "per_round_ratios": [
                    round(s / c, 3) for c, s in zip(cluster_s, sequential_s[best_threads], strict=True)
                ],
                **{
                    f"ratio_vs_{threads}_threads": round(cluster_rps / sequential_rps[threads], 3)
                    for threads in thread_counts
                },
                "cluster_utilisation": {
                    stage: round(statistics.fmean(b[stage] / wall for b, wall in zip(busy, cluster_s, strict=True)), 3)
                    for stage in busy[0]
                },
                "cluster_utilisation_per_round": [
                    {stage: round(seconds / wall, 3) for stage, seconds in b.items()}
                    for b, wall in zip(busy, cluster_s, strict=True)
                ],
                "cluster_busy_s_per_job": [
                    {stage: round(seconds / args.requests, 4) for stage, seconds in b.items()} for b in busy
                ],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
