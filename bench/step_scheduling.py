"""Scheduling at the step through the running cluster: preemption and continuous batching against today's
scheduling, and continuous against request-level batching at several loads, side by side in one run.

ONE DiT replica of wan-t2v at the `--preset` ("small" by default: 12 blocks of width 384), every stage with
`--threads` intra-op threads. Tenants: `bulk` (low), `standard` (normal) and `vip` (high). The shape, 128x128, one
frame, CFG 5, makes the DiT most of a job (about 80 ms a step on 2 cores against a 0.25 s decode), as it is at real
size (tens of seconds a step); at the tiny preset's video shapes the decode is most of a job and a benchmark of DiT
scheduling would measure the VAE.

Part one, priorities under load. Four configurations: (a) today's scheduling (`--preemption off`, no batching),
(b) `--preemption on`, (c) DiT `--max-batch-size 4 --continuous-batching` with `--preemption off`, (d) both. In
each, on the same cluster:
1. idle, one after another: `--idle-highs` high jobs alone (their median is a high job's latency when nothing else
   runs);
2. idle, the trace: the high jobs of the Poisson trace with nothing else (their p50 and p99: what the high class
   gets from the cluster at that arrival rate, its own jobs' overlaps included);
3. loaded: `--low-clients` closed-loop clients of the low tenant keep long jobs going (60 to 100 steps) while the
   same high trace (8 steps each) arrives over `--window-s`.
Reported per configuration: the high jobs' latency (submit to result) p50 and p99 loaded and idle, and the
ratios; their wait for the DiT (submit to first DiT step) and their DiT finish (submit to last DiT step) against
idle; throughput of all jobs (jobs/min and DiT steps/s over the loaded phase); the low jobs' mean latency; the
preemptions they saw. p99 is nearest-rank: with fewer than 100 high jobs it is the largest observed latency
(`p99_is_max` in the JSON).

Part two, throughput at several loads: unbatched, request-level batching (`--max-batch-size 4 --batch-wait-ms
200`: partners must have the same shape AND step count), continuous batching (`--max-batch-size 4
--continuous-batching`: the batch grows while a row's measured share of a step falls, dit_svc/batch_growth.py) and
continuous batching filling its slots (`--batch-growth full`), at concurrency 1, 2 and 4: C closed-loop clients on
the same shape, 8 and 12 steps alternating (so request-level batching finds fewer partners). The clusters run side
by side: at each load, `--blocks` blocks of `--rounds` requests per client go to each configuration in turn, the
order rotating from block to block, so that the machine's drift falls on all alike. Reported: jobs/s and mean
latency per configuration and load, the throughput ratios continuous / request-level, and the latency at
concurrency 1 against unbatched.

Every configuration gets the same seeded traces (arrivals, step counts, prompts, seeds). `--quick` runs (d) alone
with low jobs of 20 to 30 steps and a few high jobs, and part two unbatched against continuous at concurrency 1, in
about a minute: it checks that the benchmark runs; its numbers mean little. Prints one JSON object; its times are
for reading, never for asserting on.

    python bench/step_scheduling.py            # the full run (about 20 minutes on 2 cores)
    python bench/step_scheduling.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from families.init_model import init_model
from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff.client import AsyncClient, GenerationResult, Paused, Progress
from stagediff.local.supervisor import LocalCluster

TENANTS = {"bulk": "low", "standard": "normal", "vip": "high"}
SHAPE = dict(height=128, width=128, num_frames=1, guidance_scale=5.0)
HIGH_STEPS = 8
LOW_STEPS = (60, 100)  # drawn uniformly, inclusive
QUICK_LOW_STEPS = (20, 30)
LOAD_STEPS = (8, 12)  # part two: alternating step counts
CONCURRENCY = (1, 2, 4)
CONTINUOUS = ["--max-batch-size", "4", "--continuous-batching"]
REQUEST_LEVEL = ["--max-batch-size", "4", "--batch-wait-ms", "200"]
# A low job of 60 to 100 steps (11-19 s of DiT at the small preset) meets a high job every 6 s on average; at the
# cluster's default of 2 it could not be preempted again after its second, and the high jobs arriving later would
# wait for its end.
MAX_PREEMPTIONS = 10
PROMPTS = ("a red fox in snow", "a blue whale at sea", "a green kite in wind", "a yellow cab at night")

# Part one's configurations: orchestrator --preemption and the DiT's arguments.
CONFIGURATIONS = {
    "a_today": ("off", []),
    "b_preemption": ("on", []),
    "c_continuous_batching": ("off", CONTINUOUS),
    "d_both": ("on", CONTINUOUS),
}
# Part two's: the DiT's arguments.
LOAD_CONFIGURATIONS = {
    "unbatched": [],
    "request_level_batching": REQUEST_LEVEL,
    "continuous_batching": CONTINUOUS,
    "continuous_batching_full": [*CONTINUOUS, "--batch-growth", "full"],
}


@dataclass
class Trace:
    """The seeded workload every configuration gets."""

    shape: dict  # every job's size, frames and guidance
    high_offsets: list[float]  # seconds after the background is running
    low_steps: list[list[int]]  # per low client, the steps of its successive jobs

    @classmethod
    def make(
        cls, shape: dict, seed: int, window_s: float, mean_gap_s: float, low_clients: int, low_steps: tuple[int, int]
    ) -> Trace:
        rng = random.Random(seed)
        offsets: list[float] = []
        at = rng.expovariate(1.0 / mean_gap_s)
        while at < window_s:
            offsets.append(round(at, 3))
            at += rng.expovariate(1.0 / mean_gap_s)
        offsets = offsets or [round(window_s / 2, 3)]  # at least one high job
        low = [[rng.randint(*low_steps) for _ in range(256)] for _ in range(low_clients)]
        return cls(shape, offsets, low)


@dataclass
class JobRecord:
    """One job as its client saw it (times on the loop's clock)."""

    kind: str
    steps: int
    submitted: float = 0.0
    first_dit: float | None = None
    last_dit: float | None = None
    done: float | None = None
    pauses: int = 0
    error: str = ""

    @property
    def latency(self) -> float:
        assert self.done is not None
        return self.done - self.submitted


async def run_job(
    client: AsyncClient,
    kind: str,
    prompt: str,
    seed: int,
    steps: int,
    shape: dict,
    denoising: asyncio.Event | None = None,
) -> JobRecord:
    """Runs one job to its result, recording its DiT steps and pauses; sets `denoising` at its first DiT step."""
    loop = asyncio.get_running_loop()
    record = JobRecord(kind, steps, submitted=loop.time())
    try:
        async for event in client.stream(prompt, seed=seed, num_inference_steps=steps, **shape):
            if isinstance(event, Progress) and event.stage == "dit":
                record.first_dit = record.first_dit or loop.time()
                record.last_dit = loop.time()
                if denoising is not None:
                    denoising.set()
            elif isinstance(event, Paused):
                record.pauses += 1
            elif isinstance(event, GenerationResult):
                record.done = loop.time()
                break
        if record.done is None:
            record.error = "the stream ended without a result"
    except Exception as error:  # noqa: BLE001 - a failed job is reported, not raised
        record.error = f"{type(error).__name__}: {error}"[:300]
    return record


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank: with fewer than 1/(1-fraction) samples the top percentiles are the largest value."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[index]


def r3(value: float) -> float:
    return round(value, 3)


def high_request(index: int) -> tuple[str, int]:
    return PROMPTS[index % len(PROMPTS)], 1000 + index


async def idle_highs(endpoint: str, key: str, count: int, shape: dict) -> list[JobRecord]:
    async with AsyncClient(endpoint, api_key=key) as client:
        return [await run_job(client, "high", *high_request(i), HIGH_STEPS, shape) for i in range(count)]


async def loaded(endpoint: str, keys: dict[str, str], trace: Trace, low_clients: int) -> tuple[list[JobRecord], float]:
    """The high trace over `low_clients` closed-loop clients of low jobs (none: the trace alone): every job's
    record and the phase's wall time (from its first submit to its last result). With a background, the trace's
    clock starts at the first low job's first DiT step, and the low clients send no new job once the last high job
    is done."""
    records: list[JobRecord] = []
    stop = asyncio.Event()
    denoising = asyncio.Event()

    async def low_client(index: int, client: AsyncClient) -> None:
        for round_, steps in enumerate(trace.low_steps[index]):
            if stop.is_set():
                return
            prompt = PROMPTS[(index + round_) % len(PROMPTS)]
            records.append(await run_job(client, "low", prompt, 100 * index + round_, steps, trace.shape, denoising))

    async def high(index: int, client: AsyncClient, start: float) -> None:
        await asyncio.sleep(max(0.0, start + trace.high_offsets[index] - loop.time()))
        records.append(await run_job(client, "high", *high_request(index), HIGH_STEPS, trace.shape))

    loop = asyncio.get_running_loop()
    async with AsyncClient(endpoint, api_key=keys["bulk"]) as low, AsyncClient(endpoint, api_key=keys["vip"]) as vip:
        started = loop.time()
        lows = [asyncio.create_task(low_client(index, low)) for index in range(low_clients)]
        if lows:
            await asyncio.wait_for(denoising.wait(), 300)
        trace_start = loop.time()
        await asyncio.gather(*(high(index, vip, trace_start) for index in range(len(trace.high_offsets))))
        stop.set()
        await asyncio.gather(*lows)
        wall = loop.time() - started
    return records, wall


def latency_summary(records: list[JobRecord]) -> dict:
    latencies = [r.latency for r in records]
    return {
        "p50": r3(percentile(latencies, 0.50)),
        "p99": r3(percentile(latencies, 0.99)),
        "p99_is_max": len(latencies) < 100,
        "mean": r3(statistics.fmean(latencies)),
    }


def scheduling_report(idle: list[JobRecord], alone: list[JobRecord], records: list[JobRecord], wall: float) -> dict:
    """Part one's numbers for one configuration: `idle` the high jobs one after another, `alone` the high trace
    with nothing else, `records` the loaded phase."""
    failed = [r for r in idle + alone + records if r.error]
    ok = [r for r in records if not r.error]
    highs = [r for r in ok if r.kind == "high"]
    lows = [r for r in ok if r.kind == "low"]
    idle_ok = [r for r in idle if not r.error]
    alone_ok = [r for r in alone if not r.error]
    idle_median = statistics.median([r.latency for r in idle_ok]) if idle_ok else float("nan")
    report: dict = {
        "jobs": {
            "high": len(highs),
            "low": len(lows),
            "idle_high": len(idle_ok),
            "alone_high": len(alone_ok),
            "failed": len(failed),
        },
        "errors": [r.error for r in failed][:5],
        "high_idle_latency_s": {
            "median": r3(idle_median),
            "min": r3(min((r.latency for r in idle_ok), default=float("nan"))),
            "max": r3(max((r.latency for r in idle_ok), default=float("nan"))),
            "dit_finish_median": r3(statistics.median([r.last_dit - r.submitted for r in idle_ok if r.last_dit]))
            if idle_ok
            else None,
        },
    }
    if alone_ok:
        report["high_alone_latency_s"] = latency_summary(alone_ok)
        report["high_alone_dit_finish_max_s"] = r3(max(r.last_dit - r.submitted for r in alone_ok if r.last_dit))
    if highs:
        report["high_latency_s"] = latency_summary(highs)
        p99, p50 = report["high_latency_s"]["p99"], report["high_latency_s"]["p50"]
        if alone_ok:
            # The target's comparison: the high class's p99 under the low background against the same trace alone.
            report["high_p99_over_idle_p99"] = r3(p99 / report["high_alone_latency_s"]["p99"])
            report["high_p50_over_idle_p50"] = r3(p50 / report["high_alone_latency_s"]["p50"])
        report["high_p99_over_idle_median"] = r3(p99 / idle_median)
        dit_wait = [r.first_dit - r.submitted for r in highs if r.first_dit]
        dit_finish = [r.last_dit - r.submitted for r in highs if r.last_dit]
        report["high_dit_wait_s"] = {"p50": r3(percentile(dit_wait, 0.5)), "max": r3(max(dit_wait))}
        report["high_dit_finish_s"] = {"p50": r3(percentile(dit_finish, 0.5)), "max": r3(max(dit_finish))}
        if alone_ok:
            report["high_dit_finish_max_over_idle_max"] = r3(max(dit_finish) / report["high_alone_dit_finish_max_s"])
    report["low_mean_latency_s"] = r3(statistics.fmean([r.latency for r in lows])) if lows else None
    report["low_preemptions"] = sum(r.pauses for r in lows)
    report["loaded_wall_s"] = r3(wall)
    report["throughput"] = {
        "jobs_per_min": r3(60 * len(ok) / wall),
        "dit_steps_per_s": r3(sum(r.steps for r in ok) / wall),
    }
    return report


async def load_block(endpoint: str, key: str, shape: dict, concurrency: int, rounds: int) -> tuple[list, float]:
    """C closed-loop clients, `rounds` requests each, step counts alternating between LOAD_STEPS: the records and
    the block's wall time."""
    records: list[JobRecord] = []

    async def client_loop(index: int, client: AsyncClient) -> None:
        for round_ in range(rounds):
            steps = LOAD_STEPS[(index + round_) % len(LOAD_STEPS)]
            prompt = PROMPTS[index % len(PROMPTS)]
            records.append(await run_job(client, "load", prompt, 100 * index + round_, steps, shape))

    loop = asyncio.get_running_loop()
    async with AsyncClient(endpoint, api_key=key) as client:
        started = loop.time()
        await asyncio.gather(*(client_loop(index, client) for index in range(concurrency)))
        return records, loop.time() - started


def load_summary(concurrency: int, records: list[JobRecord], wall: float) -> dict:
    ok = [r for r in records if not r.error]
    return {
        "concurrency": concurrency,
        "jobs": len(ok),
        "failed": len(records) - len(ok),
        "errors": [r.error for r in records if r.error][:5],
        "wall_s": r3(wall),
        "jobs_per_s": round(len(ok) / wall, 4),
        "mean_latency_s": r3(statistics.fmean([r.latency for r in ok])) if ok else None,
    }


def rotated(names: list[str], block: int) -> list[str]:
    """The configurations' order in a block: each block starts one further along."""
    shift = block % len(names)
    return names[shift:] + names[:shift]


def tenants_file(directory: Path, keys: dict[str, str]) -> Path:
    path = directory / "tenants.yaml"
    tenants = [
        {"name": name, "api_keys": [hash_api_key(keys[name])], "priority": priority}
        for name, priority in TENANTS.items()
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def start_cluster(name: str, model: Path, tenants: Path, preemption: str, dit_args: list, args, workdir: Path):
    cluster = LocalCluster(
        model,
        threads_per_stage=args.threads,
        log_dir=workdir / f"logs-{name}",
        extra_args={
            "orchestrator": [
                *("--tenants", str(tenants), "--max-running-jobs", "16"),
                *("--preemption", preemption, "--max-preemptions", str(args.max_preemptions)),
            ],
            "dit": dit_args,
        },
    )
    cluster.start(timeout=600)
    return cluster


async def warm(endpoint: str, key: str, shape: dict) -> None:
    """First calls: lazy imports and allocations, and a batch of two where one forms."""
    async with AsyncClient(endpoint, api_key=key) as client:
        await run_job(client, "warm", PROMPTS[0], 1, HIGH_STEPS, shape)
        await asyncio.gather(*(run_job(client, "warm", PROMPTS[i], i, LOAD_STEPS[0], shape) for i in range(2)))


def scheduling_run(name: str, model: Path, keys: dict, tenants: Path, trace: Trace, args, workdir: Path) -> dict:
    """Part one for one configuration, on a cluster of its own."""
    preemption, dit_args = CONFIGURATIONS[name]
    cluster = start_cluster(name, model, tenants, preemption, dit_args, args, workdir)
    try:
        endpoint = cluster.endpoint
        asyncio.run(warm(endpoint, keys["standard"], trace.shape))
        idle = asyncio.run(idle_highs(endpoint, keys["vip"], args.idle_highs, trace.shape))
        alone, _ = asyncio.run(loaded(endpoint, keys, trace, low_clients=0))
        records, wall = asyncio.run(loaded(endpoint, keys, trace, low_clients=len(trace.low_steps)))
        return scheduling_report(idle, alone, records, wall)
    finally:
        cluster.stop()


def load_run(names: list[str], model: Path, keys: dict, tenants: Path, args, workdir: Path) -> dict:
    """Part two: the configurations' clusters side by side, blocks of each load in rotating order."""
    clusters = {
        name: start_cluster(name, model, tenants, "off", LOAD_CONFIGURATIONS[name], args, workdir) for name in names
    }
    try:
        for cluster in clusters.values():
            asyncio.run(warm(cluster.endpoint, keys["standard"], args.load_shape))
        levels: dict[str, list[dict]] = {name: [] for name in names}
        for concurrency in args.concurrency:
            records: dict[str, list[JobRecord]] = {name: [] for name in names}
            walls = dict.fromkeys(names, 0.0)
            for block in range(args.blocks):
                for name in rotated(names, block):
                    block_records, wall = asyncio.run(
                        load_block(clusters[name].endpoint, keys["standard"], args.load_shape, concurrency, args.rounds)
                    )
                    records[name] += block_records
                    walls[name] += wall
            for name in names:
                levels[name].append(load_summary(concurrency, records[name], walls[name]))
        return levels
    finally:
        for cluster in clusters.values():
            cluster.stop()


def machine() -> dict:
    model_name = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    return {"cpu": model_name, "cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="(d) alone, a few jobs: that it runs (about a minute)")
    parser.add_argument("--preset", default="small", help="the wan-t2v preset (default: small)")
    parser.add_argument("--seed", type=int, default=0, help="the traces' seed")
    parser.add_argument("--window-s", type=float, default=None, help="high arrivals over this many seconds")
    parser.add_argument("--mean-gap-s", type=float, default=None, help="mean seconds between high arrivals")
    parser.add_argument("--low-clients", type=int, default=2, help="closed-loop clients of low jobs")
    parser.add_argument("--idle-highs", type=int, default=None, help="high jobs run one after another when idle")
    parser.add_argument("--blocks", type=int, default=None, help="part two: blocks per configuration and load")
    parser.add_argument("--rounds", type=int, default=None, help="part two: requests per client in a block")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per stage")
    parser.add_argument(
        "--concurrency",
        type=lambda value: tuple(int(level) for level in value.split(",")),
        default=None,
        help=f"part two's loads, comma-separated (default: {','.join(map(str, CONCURRENCY))})",
    )
    parser.add_argument(
        "--max-preemptions", type=int, default=MAX_PREEMPTIONS, help="the orchestrator's --max-preemptions"
    )
    parser.add_argument(
        "--configurations",
        type=lambda value: value.split(",") if value else [],
        default=None,
        help=f"part one's configurations, comma-separated (default: all of {', '.join(CONFIGURATIONS)})",
    )
    parser.add_argument(
        "--load-configurations",
        type=lambda value: value.split(",") if value else [],
        default=None,
        help=f"part two's, comma-separated; empty: no part two (default: all of {', '.join(LOAD_CONFIGURATIONS)})",
    )
    args = parser.parse_args()
    for flag, chosen, known in (
        ("--configurations", args.configurations, CONFIGURATIONS),
        ("--load-configurations", args.load_configurations, LOAD_CONFIGURATIONS),
    ):
        unknown = [name for name in chosen or () if name not in known]
        if unknown:
            parser.error(f"{flag}: {', '.join(unknown)} unknown; allowed: {', '.join(known)}")
    defaults = dict(window_s=(3.0, 90.0), mean_gap_s=(1.5, 6.0), idle_highs=(1, 3), blocks=(1, 3), rounds=(1, 2))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.concurrency is None:
        args.concurrency = (1,) if args.quick else CONCURRENCY
    args.low_steps = QUICK_LOW_STEPS if args.quick else LOW_STEPS
    args.load_shape = SHAPE

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-step-scheduling-"))
    model = init_model("wan-t2v", args.preset, workdir / args.preset, seed=0)
    keys = {name: new_api_key() for name in TENANTS}
    tenants = tenants_file(workdir, keys)
    trace = Trace.make(SHAPE, args.seed, args.window_s, args.mean_gap_s, args.low_clients, args.low_steps)
    started = time.perf_counter()
    scheduling_names = args.configurations
    if scheduling_names is None:
        scheduling_names = ["d_both"] if args.quick else list(CONFIGURATIONS)
    scheduling = {name: scheduling_run(name, model, keys, tenants, trace, args, workdir) for name in scheduling_names}
    load_names = args.load_configurations
    if load_names is None:
        load_names = ["unbatched", "continuous_batching"] if args.quick else list(LOAD_CONFIGURATIONS)
    load = load_run(load_names, model, keys, tenants, args, workdir) if load_names else {}

    report: dict = {
        "benchmark": "step_scheduling",
        "quick": args.quick,
        "model": f"wan-t2v {args.preset}, one DiT replica",
        "scheduling": {
            "workload": {
                "shape": trace.shape,
                "high_steps": HIGH_STEPS,
                "low_steps_range": list(args.low_steps),
                "low_clients": args.low_clients,
                "high_arrivals": len(trace.high_offsets),
                "high_offsets_s": trace.high_offsets,
                "window_s": args.window_s,
                "mean_gap_s": args.mean_gap_s,
                "idle_highs": args.idle_highs,
                "seed": args.seed,
                "p99_note": "nearest rank: with fewer than 100 high jobs the p99 is the largest observed latency",
            },
            "configurations": {
                name: {"preemption": CONFIGURATIONS[name][0], "dit_args": CONFIGURATIONS[name][1], **result}
                for name, result in scheduling.items()
            },
        },
        "load": {
            "workload": {
                "shape": args.load_shape,
                "steps_alternating": list(LOAD_STEPS),
                "blocks": args.blocks,
                "rounds_per_client_in_a_block": args.rounds,
                "concurrency": list(args.concurrency),
            },
            "configurations": {name: {"dit_args": LOAD_CONFIGURATIONS[name]} for name in load_names},
            "levels": load,
        },
    }
    report["ratios"] = ratios(scheduling, load)
    report.update(threads_per_stage=args.threads, machine=machine(), total_wall_s=r3(time.perf_counter() - started))
    print(json.dumps(report, indent=2))


def ratios(scheduling: dict, load: dict) -> dict:
    """The comparisons the run is for."""
    out: dict = {
        "high_p99_over_idle_p99": {n: s.get("high_p99_over_idle_p99") for n, s in scheduling.items()},
        "high_p99_over_idle_median": {n: s.get("high_p99_over_idle_median") for n, s in scheduling.items()},
        "high_dit_finish_max_over_idle_max": {
            n: s.get("high_dit_finish_max_over_idle_max") for n, s in scheduling.items()
        },
    }
    for name, key in (("continuous_batching", "continuous"), ("continuous_batching_full", "continuous_full")):
        if name in load and "request_level_batching" in load:
            out[f"throughput_{key}_over_request_level"] = {
                str(c["concurrency"]): r3(c["jobs_per_s"] / q["jobs_per_s"])
                for c, q in zip(load[name], load["request_level_batching"], strict=True)
            }
    if "continuous_batching" in load and "unbatched" in load:
        out["throughput_continuous_over_unbatched"] = {
            str(c["concurrency"]): r3(c["jobs_per_s"] / u["jobs_per_s"])
            for c, u in zip(load["continuous_batching"], load["unbatched"], strict=True)
        }
        unbatched_c1 = load["unbatched"][0]["mean_latency_s"]
        out["latency_at_concurrency_1_over_unbatched"] = {
            name: r3(levels[0]["mean_latency_s"] / unbatched_c1) for name, levels in load.items()
        }
    return out


if __name__ == "__main__":
    main()
