"""Request batching in the DiT: throughput and per-request latency at concurrency 1, 2 and 4, batching off and
on, through the running cluster, side by side in one run.

For each preset, the local cluster runs twice on the same checkpoint: once as deployed by default
(`--max-batch-size 1`), once with `--max-batch-size 4 --batch-wait-ms W`. At each concurrency C, C clients
send requests of the preset's default size with different prompts and seeds, `--rounds` each, one after
another; the report gives requests per second over the whole level, the median latency of a request, and
the ratio of batched to unbatched throughput. Every stage gets `--threads` intra-op threads. Prints JSON.

    python bench/batching.py [--presets tiny,small] [--rounds 2] [--wait-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from families.init_model import init_model
from families.wan.presets import DEFAULT_REQUESTS
from stagediff.client import AsyncClient
from stagediff.local.compose import DEFAULT_COMPOSE_FILE
from stagediff.local.supervisor import LocalCluster

CONCURRENCY = (1, 2, 4)
PROMPTS = ("a red fox in snow", "a blue whale at sea", "a green kite in wind", "a yellow cab at night")


async def level(endpoint: str, request: dict, concurrency: int, rounds: int) -> dict:
    """C clients, `rounds` requests each: requests per second and the median latency of one request."""
    latencies: list[float] = []

    async def client_loop(index: int) -> None:
        async with AsyncClient(endpoint) as client:
            for round_ in range(rounds):
                started = time.perf_counter()
                await client.generate(PROMPTS[index % len(PROMPTS)], seed=100 * index + round_, **request)
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client_loop(index) for index in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / wall, 4),
        "median_latency_s": round(statistics.median(latencies), 3),
    }


def measure(model: Path, request: dict, dit_args: list[str], args: argparse.Namespace, logs: Path) -> list[dict]:
    cluster = LocalCluster(
        model,
        compose_file=args.file,
        threads_per_stage=args.threads,
        log_dir=logs,
        extra_args={"dit": dit_args},
    )
    cluster.start(timeout=600)
    try:
        asyncio.run(level(cluster.endpoint, request, 1, 1))  # warm-up
        return [asyncio.run(level(cluster.endpoint, request, c, args.rounds)) for c in CONCURRENCY]
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency")
    parser.add_argument("--wait-ms", type=float, default=50.0, help="--batch-wait-ms of the batched cluster")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "-f",
        "--file",
        default=str(DEFAULT_COMPOSE_FILE),
        help="compose file (a GPU machine: docker-compose.single-gpu.yml)",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stagediff-batching-"))
    report = {"benchmark": "dit_request_batching", "presets": {}}
    for preset in args.presets.split(","):
        model = init_model("wan-t2v", preset, workdir / preset, seed=0)
        request = DEFAULT_REQUESTS[preset]
        off = measure(model, request, [], args, workdir / f"{preset}-off")
        batched = ["--max-batch-size", "4", "--batch-wait-ms", f"{args.wait_ms:g}"]
        on = measure(model, request, batched, args, workdir / f"{preset}-on")
        report["presets"][preset] = {
            "request": request,
            "batching_off": off,
            "batching_on": on,
            "throughput_ratio_on_over_off": {
                str(a["concurrency"]): round(b["requests_per_s"] / a["requests_per_s"], 3)
                for a, b in zip(off, on, strict=True)
            },
        }
    report.update(
        wait_ms=args.wait_ms,
        compose_file=Path(args.file).name,
        threads_per_stage=args.threads,
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
