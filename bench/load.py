"""Throughput and latency of a local cluster under concurrent clients, at several concurrency levels.

Starts the local cluster on the tiny preset (or `--model`), warms it, then for each concurrency
level C keeps C requests in flight (a closed loop: each client sends its next request when the
previous one finishes) until `--requests-per-level` have completed. Latency is measured per request
from send to the last frame received; throughput is completed requests over the level's wall time.
Prints one JSON object.

    python bench/load.py --concurrency 1 4 16 --requests-per-level 32
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
from pathlib import Path

import torch

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from stagediff import AsyncClient
from stagediff.local.supervisor import LocalCluster

PROMPTS = ("a red fox running through fresh snow", "a lighthouse in a storm at night", "waves on a pebble beach")


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (no interpolation: with few samples it is an observed latency)."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[index]


async def run_level(endpoint: str, concurrency: int, total: int, request: dict, api_key: str | None) -> dict:
    """Keeps `concurrency` requests in flight until `total` have completed."""
    latencies: list[float] = []
    next_index = 0

    async def client_loop(client: AsyncClient) -> None:
        nonlocal next_index
        while next_index < total:
            index = next_index
            next_index += 1
            started = time.perf_counter()
            await client.generate(PROMPTS[index % len(PROMPTS)], seed=index, **request)
            latencies.append(time.perf_counter() - started)

    options = {"api_key": api_key} if api_key else {}
    async with AsyncClient(endpoint, **options) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "wall_s": round(wall, 3),
        "throughput_rps": round(len(latencies) / wall, 4),
        "p50_s": round(percentile(latencies, 0.50), 3),
        "p95_s": round(percentile(latencies, 0.95), 3),
        "mean_s": round(statistics.fmean(latencies), 3),
    }


async def run_all(endpoint: str, args: argparse.Namespace, request: dict) -> list[dict]:
    async with AsyncClient(endpoint, **({"api_key": args.api_key} if args.api_key else {})) as client:
        await client.generate(PROMPTS[0], seed=0, **request)  # warm: lazy imports, first-call allocations
    return [
        await run_level(endpoint, concurrency, args.requests_per_level, request, args.api_key)
        for concurrency in args.concurrency
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--endpoint", help="an already running cluster (default: start a local one)")
    parser.add_argument("--api-key", help="API key for a cluster started with --tenants")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-level", type=int, default=32)
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--max-running-jobs", type=int, default=4)
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.requests_per_level < 1:
        parser.error("--concurrency and --requests-per-level must be at least 1")

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-load-"))
    model = Path(args.model) if args.model else init_model("wan-t2v", args.preset, workdir / args.preset)
    request = dict(DEFAULT_REQUESTS[args.preset])

    cluster = None
    endpoint = args.endpoint
    if endpoint is None:
        cluster = LocalCluster(
            model,
            threads_per_stage=args.threads_per_stage,
            log_dir=workdir / "logs",
            extra_args={"orchestrator": ["--max-running-jobs", str(args.max_running_jobs)]},
        )
        cluster.start(timeout=600)
        endpoint = cluster.endpoint
    try:
        levels = asyncio.run(run_all(endpoint, args, request))
    finally:
        if cluster is not None:
            cluster.stop()

    print(
        json.dumps(
            {
                "benchmark": "load",
                "preset": args.preset,
                "request": request,
                "threads_per_stage": args.threads_per_stage,
                "max_running_jobs": args.max_running_jobs,
                "levels": levels,
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
