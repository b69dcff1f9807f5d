"""The orchestrator's resident memory under hostile traffic, on a local cluster of the tiny preset.

Three scenarios, run in this order on one cluster (a fresh state directory, the open tenant, one torch
thread per stage). Each starts on a fresh orchestrator process (the first, then one restarted with SIGTERM
on the same port and state directory), warmed by one small job (so that lazy imports and first-call
allocations are not counted), and reads its own "before": memory one scenario freed inside the process but
kept from the system would otherwise hide what the next one takes.

  1. refused: `--refused` (24) Submit calls, one after another, each with a different `--model-mib`
     (16) MiB `model` string and otherwise a valid request. They are refused (NOT_FOUND, INVALID_ARGUMENT,
     or RESOURCE_EXHAUSTED from grpc itself where the orchestrator takes smaller messages); the codes are
     recorded. Resident memory after them, against before.
  2. jobs: `--jobs` (20) large jobs, `--concurrency` (2) at a time through Generate, each stream read to
     its end: the tiny preset's default size (64x64, 2 steps, CFG) with `--num-frames` 33 and frame
     interpolation at `--interp-exp` 4, (33 - 1) * 2**4 + 1 = 513 frames, 6.3 MB of uint8 frames each.
     Resident memory after they finished, against before, and the peak while they ran.
  3. replays: `--replays` (16) concurrent WatchJob streams of the first of those jobs, each read to its
     end, together with as many concurrent GetJob calls on it; the peak resident memory while they run,
     against before. Twice: `replays_live`, right after the jobs, in the orchestrator process that ran
     them, and `replays_stored`, in a fresh orchestrator process, for which the result exists only in the
     store. The issue's target applies to the stored one.

Resident memory is VmRSS of the orchestrator process (the `serve orchestrator` process of the cluster) from
/proc/PID/status. A peak is the larger of VmHWM, reset through /proc/PID/clear_refs before the scenario,
and the largest VmRSS a thread sampled every 10 ms during it. Readings "after" are taken `--settle-s`
seconds after the last call ended. MiB = 2**20 bytes.

`--source DIR` measures the code of the source tree DIR (default: the repository this file is in);
`--compare OLD_DIR` measures OLD_DIR first, then DIR, on the same checkpoint, and prints both with the
ratios. Each tree runs in its own process with PYTHONPATH and the working directory set to the tree, so
that the cluster it starts (LocalCluster starts `python -m stagediff.cli` with the PYTHONPATH of the tree
its own module comes from) runs that tree's code; the output names the file each of the orchestrator
process's modules is imported from, and the tree's commit (with how many files differ from it).

Bounded: each scenario has a deadline (`--scenario-timeout`), every call a gRPC deadline within it, each
tree a deadline (`--tree-timeout`) after which its process is stopped; the cluster is stopped whatever
happens, and any of its processes still alive afterwards is killed.

    python bench/hostile.py
    python bench/hostile.py --compare /tmp/stagediff-before
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2, generation_pb2_grpc

REPOSITORY = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SAMPLE_INTERVAL_S = 0.01
# A client that sends 16 MiB strings and reads whole results: far above any size used here.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
PROMPT = "a red fox running through fresh snow"
# The tiny preset's default size and steps (families.wan.init_model.DEFAULT_REQUESTS["tiny"]).
HEIGHT, WIDTH, STEPS, GUIDANCE = 64, 64, 2, 5.0
TARGETS_MIB = {"refused_delta": 32, "replays_stored_peak_growth": 64}
SERVE_ORCHESTRATOR = ("stagediff.cli", "serve", "orchestrator")


# --------------------------------------------------------------------------------------------- memory --


def read_status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0])
    return values


def rss_mib(pid: int) -> float:
    return round(read_status_kib(pid)["VmRSS"] / 1024, 1)


def reset_peak(pid: int) -> bool:
    """Resets the process's VmHWM to its current VmRSS (`echo 5 > /proc/PID/clear_refs`); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class PeakWatch:
    """The peak resident memory of a process over a `with` block: VmHWM reset at the start (where the kernel
    allows it) and VmRSS sampled every SAMPLE_INTERVAL_S by a thread, whichever is larger."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sampled_kib = 0
        self.hwm_kib = 0
        self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled_kib = max(self.sampled_kib, read_status_kib(self.pid)["VmRSS"])
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> PeakWatch:
        self.hwm_reset = reset_peak(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.hwm_kib = read_status_kib(self.pid)["VmHWM"]

    @property
    def peak_mib(self) -> float:
        peak = max(self.sampled_kib, self.hwm_kib) if self.hwm_reset else self.sampled_kib
        return round(peak / 1024, 1)


# ----------------------------------------------------------------------------------------- the cluster --


def orchestrator_name(cluster: LocalCluster) -> str:
    """The cluster's orchestrator service, checked to be the `serve orchestrator` process itself (its pid is the
    process whose memory is read, not a wrapper's)."""
    name = next(name for name in cluster.services if cluster.compose[name].is_entry)
    cmdline = Path(f"/proc/{cluster.services[name].pid}/cmdline").read_bytes().split(b"\0")
    if not all(part.encode() in cmdline for part in SERVE_ORCHESTRATOR):
        raise RuntimeError(f"{name} (pid {cluster.services[name].pid}) does not run `{' '.join(SERVE_ORCHESTRATOR)}`")
    return name


def imported_from(pid: int) -> dict[str, str]:
    """The files the process `pid` imports the orchestrator's modules from: a Python started with its
    environment and working directory resolves them."""
    environment = dict(
        entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry
    )
    script = (
        "import json, stagediff, services.orchestrator.service as s, services.orchestrator.jobs as j; "
        "print(json.dumps({m.__name__: m.__file__ for m in (stagediff, s, j)}))"
    )
    found = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        cwd=os.readlink(f"/proc/{pid}/cwd"),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(found.stdout)


def git_state(tree: Path) -> dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout

    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "changed_tracked_files": len(changed)}


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the scenario ran past --scenario-timeout")
    return left


def log(message: str) -> None:
    print(f"[hostile] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ scenarios --


def large_request(args: argparse.Namespace, seed: int) -> generation_pb2.GenerateRequest:
    """The tiny preset's default size and steps, with `--num-frames` and interpolation at `--interp-exp`."""
    return generation_pb2.GenerateRequest(
        prompt=f"{PROMPT}, take {seed}",
        height=HEIGHT,
        width=WIDTH,
        num_frames=args.num_frames,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        seed=seed,
        interpolation=generation_pb2.InterpolationParams(enable=True, exp=args.interp_exp),
    )


def generate(stub, request: generation_pb2.GenerateRequest, timeout: float) -> dict[str, object]:
    """Runs a request through Generate, reading the stream to its end."""
    job_id, result_bytes = "", 0
    try:
        for event in stub.Generate(request, timeout=timeout):
            job_id = job_id or event.job_id
            result_bytes += len(event.result.tensor.data)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    return {"job_id": job_id, "code": code.name, "result_bytes": result_bytes}


def refused_requests(stub, pid: int, args: argparse.Namespace, deadline: float) -> dict[str, object]:
    codes: Counter[str] = Counter()
    before = rss_mib(pid)
    started = time.perf_counter()
    with PeakWatch(pid) as peak:
        for index in range(args.refused):
            prefix = f"hostile-model-{index:03d}-"
            model = prefix + "m" * (args.model_mib * MIB - len(prefix))
            request = generation_pb2.GenerateRequest(model=model, prompt=PROMPT, num_frames=1, num_inference_steps=1)
            try:
                stub.Submit(request, timeout=min(60.0, remaining(deadline)))
                codes["OK"] += 1
            except grpc.RpcError as error:
                codes[error.code().name] += 1
    wall = time.perf_counter() - started
    time.sleep(args.settle_s)
    after = rss_mib(pid)
    return {
        "requests": args.refused,
        "model_mib": args.model_mib,
        "codes": dict(codes),
        "rss_before_mib": before,
        "rss_after_mib": after,
        "delta_mib": round(after - before, 1),
        "peak_mib": peak.peak_mib,
        "wall_s": round(wall, 1),
    }


def large_jobs(stub, pid: int, args: argparse.Namespace, deadline: float) -> dict[str, object]:
    before = rss_mib(pid)
    started = time.perf_counter()
    with PeakWatch(pid) as peak, ThreadPoolExecutor(args.concurrency) as pool:
        runs = list(
            pool.map(
                lambda seed: generate(stub, large_request(args, seed), timeout=remaining(deadline)),
                range(1, args.jobs + 1),
            )
        )
    wall = time.perf_counter() - started
    time.sleep(args.settle_s)
    after = rss_mib(pid)
    frame_bytes = HEIGHT * WIDTH * 3
    return {
        "jobs": args.jobs,
        "concurrency": args.concurrency,
        "codes": dict(Counter(run["code"] for run in runs)),
        "frames_per_job": sorted({run["result_bytes"] // frame_bytes for run in runs}),
        "rss_before_mib": before,
        "rss_after_mib": after,
        "delta_mib": round(after - before, 1),
        "peak_mib": peak.peak_mib,
        "peak_growth_mib": round(peak.peak_mib - before, 1),
        "wall_s": round(wall, 1),
        "job_ids": [run["job_id"] for run in runs],
    }


def replays(stub, pid: int, job_id: str, args: argparse.Namespace, deadline: float) -> dict[str, object]:
    """`--replays` WatchJob streams read to their end and as many GetJob calls, all started at once."""
    start = threading.Barrier(2 * args.replays)

    def watch() -> tuple[str, int]:
        start.wait(timeout=60)
        received = 0
        try:
            for event in stub.WatchJob(
                generation_pb2.WatchJobRequest(job_id=job_id), timeout=min(120.0, remaining(deadline))
            ):
                received += len(event.result.tensor.data)
        except grpc.RpcError as error:
            return error.code().name, received
        return "OK", received

    def get() -> tuple[str, int]:
        start.wait(timeout=60)
        try:
            job = stub.GetJob(generation_pb2.GetJobRequest(job_id=job_id), timeout=min(120.0, remaining(deadline)))
        except grpc.RpcError as error:
            return error.code().name, 0
        return "OK", job.ByteSize()

    before = rss_mib(pid)
    started = time.perf_counter()
    with PeakWatch(pid) as peak, ThreadPoolExecutor(2 * args.replays) as pool:
        watched = [pool.submit(watch) for _ in range(args.replays)]
        got = [pool.submit(get) for _ in range(args.replays)]
        watched = [future.result() for future in watched]
        got = [future.result() for future in got]
    wall = time.perf_counter() - started
    time.sleep(args.settle_s)
    after = rss_mib(pid)
    return {
        "job_id": job_id,
        "watch_streams": args.replays,
        "watch_codes": dict(Counter(code for code, _ in watched)),
        "bytes_per_stream": sorted({received for _, received in watched}),
        "get_calls": args.replays,
        "get_codes": dict(Counter(code for code, _ in got)),
        "get_response_bytes": sorted({size for _, size in got}),
        "rss_before_mib": before,
        "peak_mib": peak.peak_mib,
        "peak_growth_mib": round(peak.peak_mib - before, 1),
        "rss_after_mib": after,
        "peak_from": "VmHWM after reset and sampled VmRSS" if peak.hwm_reset else "sampled VmRSS",
        "wall_s": round(wall, 1),
    }


def restart_orchestrator(cluster: LocalCluster, timeout: float) -> int:
    """Stops the orchestrator with SIGTERM (SIGKILL if it has not exited within 30 s), starts it again on the
    same port and state directory, and returns its new pid."""
    name = orchestrator_name(cluster)
    process = cluster.services[name].process
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        cluster.kill(name)
    cluster.restart(name, timeout=timeout)
    return cluster.services[orchestrator_name(cluster)].pid


def warm_up(stub, timeout: float) -> None:
    """One small job with interpolation, streamed, then watched and looked up: the orchestrator's lazy imports
    and first-call allocations happen here, before a baseline is read."""
    request = generation_pb2.GenerateRequest(
        prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=9, num_inference_steps=STEPS
    )
    request.interpolation.enable, request.interpolation.exp = True, 1
    run = generate(stub, request, timeout=timeout)
    assert run["code"] == "OK", f"the warm-up job ended with {run['code']}"
    list(stub.WatchJob(generation_pb2.WatchJobRequest(job_id=run["job_id"]), timeout=60))
    stub.GetJob(generation_pb2.GetJobRequest(job_id=run["job_id"]), timeout=60)


def measure_tree(args: argparse.Namespace) -> dict[str, object]:
    """Runs every scenario against a cluster of the tree this process imports stagediff from.

    Each scenario starts on a fresh, warmed orchestrator process (the first one, then one restarted on the
    same state directory for the jobs, then another for the stored replays): memory a scenario freed inside
    the process but kept from the system would otherwise hide what the next one takes."""
    workdir = Path(args.workdir)
    pids_file = workdir / "pids"
    cluster = LocalCluster(
        args.model,
        threads_per_stage=args.threads_per_stage,
        log_dir=workdir / "logs",
        state_dir=workdir / "state",
        extra_args={"orchestrator": ["--max-running-jobs", str(args.concurrency)]},
    )

    def record_pid(pid: int) -> None:
        with pids_file.open("a") as pids:
            pids.write(f"{pid}\n")

    def fresh_stub():
        channel = grpc.insecure_channel(cluster.endpoint, options=CHANNEL_OPTIONS)
        stub = generation_pb2_grpc.GenerationStub(channel)
        warm_up(stub, timeout=args.scenario_timeout)
        time.sleep(args.settle_s)
        return channel, stub

    result: dict[str, object] = {"source": args.source, **git_state(Path(args.source))}
    try:
        cluster.start(timeout=args.scenario_timeout, on_started=lambda service: record_pid(service.pid))
        pid = cluster.services[orchestrator_name(cluster)].pid
        result["imported_from"] = imported_from(pid)
        log(f"{args.source}: cluster up, orchestrator pid {pid}, modules {result['imported_from']}")

        channel, stub = fresh_stub()
        result["baseline_rss_mib"] = rss_mib(pid)
        result["refused"] = refused_requests(stub, pid, args, time.monotonic() + args.scenario_timeout)
        log(f"refused: {result['refused']}")
        channel.close()

        pid = restart_orchestrator(cluster, timeout=args.scenario_timeout)
        record_pid(pid)
        channel, stub = fresh_stub()
        jobs = large_jobs(stub, pid, args, time.monotonic() + args.scenario_timeout)
        result["jobs"] = jobs
        log(f"jobs: {jobs}")
        replayed = jobs["job_ids"][0]
        result["replays_live"] = replays(stub, pid, replayed, args, time.monotonic() + args.scenario_timeout)
        log(f"replays_live: {result['replays_live']}")
        channel.close()

        pid = restart_orchestrator(cluster, timeout=args.scenario_timeout)
        record_pid(pid)
        channel, stub = fresh_stub()
        result["replays_stored"] = replays(stub, pid, replayed, args, time.monotonic() + args.scenario_timeout)
        log(f"replays_stored: {result['replays_stored']}")
        channel.close()
    finally:
        cluster.stop()
    return result


# ---------------------------------------------------------------------------------------------- driver --


def kill_leftovers(pids_file: Path) -> list[int]:
    """Kills (with their sessions) the cluster processes a tree's run started that are still alive."""
    killed = []
    if not pids_file.is_file():
        return killed
    for pid in {int(line) for line in pids_file.read_text().split()}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited
        if b"stagediff.cli" in cmdline:
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def run_tree(tree: Path, label: str, model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, object]:
    """Measures `tree` in a process that imports stagediff from it."""
    tree_dir = workdir / label
    tree_dir.mkdir()
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--source",
        str(tree),
        "--model",
        str(model),
        "--workdir",
        str(tree_dir),
    ]
    for name in ("refused", "model_mib", "jobs", "concurrency", "replays", "num_frames", "interp_exp"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--threads-per-stage", str(args.threads_per_stage), "--settle-s", str(args.settle_s)]
    command += ["--scenario-timeout", str(args.scenario_timeout)]
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    log(f"measuring {tree} ({label})")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=tree, env=environment)
    try:
        code = process.wait(timeout=args.tree_timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # the worker stops its cluster on SIGTERM
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        code = None
    finally:
        killed = kill_leftovers(tree_dir / "pids")
    if code != 0:
        reason = "ran past --tree-timeout" if code is None else f"exited with {code}"
        raise RuntimeError(f"measuring {tree} {reason}; logs in {tree_dir / 'logs'}")
    result = json.loads((tree_dir / "result.json").read_text())
    result["tree_wall_s"] = round(time.perf_counter() - started, 1)
    if killed:
        result["killed_leftover_pids"] = killed
    return result


def targets(result: dict[str, object]) -> dict[str, object]:
    refused, stored = result["refused"]["delta_mib"], result["replays_stored"]["peak_growth_mib"]
    return {
        "refused_delta_mib": refused,
        "refused_delta_target_mib": TARGETS_MIB["refused_delta"],
        "refused_meets_target": refused <= TARGETS_MIB["refused_delta"],
        "replays_stored_peak_growth_mib": stored,
        "replays_peak_growth_target_mib": TARGETS_MIB["replays_stored_peak_growth"],
        "replays_meet_target": stored <= TARGETS_MIB["replays_stored_peak_growth"],
    }


def ratio(after: float, before: float) -> float | None:
    return round(after / before, 3) if before > 0 else None


def comparison(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    rows = {
        "baseline_rss_mib": ("baseline_rss_mib",),
        "refused_delta_mib": ("refused", "delta_mib"),
        "jobs_delta_mib": ("jobs", "delta_mib"),
        "jobs_peak_growth_mib": ("jobs", "peak_growth_mib"),
        "replays_live_peak_growth_mib": ("replays_live", "peak_growth_mib"),
        "replays_stored_peak_growth_mib": ("replays_stored", "peak_growth_mib"),
    }
    table = {}
    for name, path in rows.items():
        old, new = before, after
        for key in path:
            old, new = old[key], new[key]
        table[name] = {"before": old, "after": new, "after_over_before": ratio(new, old)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(REPOSITORY), help="source tree to measure (default: this repository)")
    parser.add_argument("--compare", metavar="OLD_DIR", help="also measure this source tree, first, side by side")
    parser.add_argument("--model", help="tiny checkpoint (default: made with `stagediff init-model --preset tiny`)")
    parser.add_argument("--refused", type=int, default=24, help="refused Submit calls in scenario 1")
    parser.add_argument("--model-mib", type=int, default=16, help="size of each refused call's model string")
    parser.add_argument("--jobs", type=int, default=20, help="large jobs in scenario 2")
    parser.add_argument("--concurrency", type=int, default=2, help="large jobs at a time (and --max-running-jobs)")
    parser.add_argument("--replays", type=int, default=16, help="concurrent WatchJob (and GetJob) calls")
    parser.add_argument("--num-frames", type=int, default=33, help="frames of each large job before interpolation")
    parser.add_argument("--interp-exp", type=int, default=4, help="interpolation of each large job (2**exp)")
    parser.add_argument("--threads-per-stage", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait before an 'after' reading")
    parser.add_argument("--scenario-timeout", type=float, default=300.0, help="seconds each scenario may take")
    parser.add_argument("--tree-timeout", type=float, default=900.0, help="seconds each tree's run may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.refused, args.model_mib, args.jobs, args.concurrency, args.replays) < 1:
        parser.error("--refused, --model-mib, --jobs, --concurrency and --replays must be at least 1")

    if args.worker:
        # SIGTERM from the driver unwinds through measure_tree's `finally`, which stops the cluster.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
        result = measure_tree(args)
        Path(args.workdir, "result.json").write_text(json.dumps(result, indent=2))
        return

    workdir = Path(tempfile.mkdtemp(prefix="stagediff-hostile-"))
    source = Path(args.source).resolve()
    model = Path(args.model).resolve() if args.model else workdir / "tiny"
    if not args.model:
        subprocess.run(
            [sys.executable, "-m", "stagediff.cli", "init-model", "--family", "wan-t2v", "--preset", "tiny"]
            + ["--out", str(model)],
            cwd=source,
            env={**os.environ, "PYTHONPATH": str(source)},
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=600,
        )
    output: dict[str, object] = {
        "benchmark": "hostile",
        "preset": "tiny",
        "large_job": {
            "height": HEIGHT,
            "width": WIDTH,
            "num_frames": args.num_frames,
            "interp_exp": args.interp_exp,
            "frames_out": (args.num_frames - 1) * 2**args.interp_exp + 1,
            "num_inference_steps": STEPS,
            "guidance_scale": GUIDANCE,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }
    if args.compare:
        before = run_tree(Path(args.compare).resolve(), "before", model, workdir, args)
        after = run_tree(source, "after", model, workdir, args)
        output |= {
            "before": before,
            "after": after,
            "comparison": comparison(before, after),
            "targets_before": targets(before),
            "targets_after": targets(after),
        }
    else:
        measured = run_tree(source, "tree", model, workdir, args)
        output |= {"result": measured, "targets": targets(measured)}
    print(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
