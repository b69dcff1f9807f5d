"""The orchestrator's and the HTTP gateway's resident memory and answers under hostile traffic, on a local
cluster of the tiny preset.

The scenarios, run in this order on one cluster of the `--family` (wan2.2-ti2v: text-only and image
requests) tiny preset (a fresh state directory, the open tenant, one torch thread per stage). Each starts on
a fresh orchestrator process (the first, then one restarted with SIGTERM on the same port and state
directory), warmed by one small job (so that lazy imports and first-call allocations are not counted), and
reads its own "before": memory one scenario freed inside the process but kept from the system would
otherwise hide what the next one takes. `--scenarios` picks them (refused always runs).

  refused: for each count in `--refused` (24,96), that many Submit calls, one after another, each with a
     different `--model-mib` (16) MiB `model` string and otherwise a valid request. They are refused
     (NOT_FOUND, INVALID_ARGUMENT, or RESOURCE_EXHAUSTED from grpc itself where the orchestrator takes
     smaller messages); the codes are recorded. Resident memory after them, against before.
  gateway: against the cluster's own HTTP gateway (`serve http`, which LocalCluster starts), without an API key:
     `gateway_idle`, IDLE_CONNECTIONS TCP connections opened and left silent, then GET /healthz timed (its status,
     or 0 where none came within GATEWAY_WAIT_S), then how many of them the server closed within GATEWAY_WAIT_S;
     `gateway_json`, one JSON_BODY_MIB MiB `{"a":[{},{},...]}` posted with its Content-Length to /v1/videos
     without an Authorization header: its status and the gateway process's resident memory and peak.
  images: `image_attacks`, `--attackers` (2) threads sending a scan-bomb JPEG, a 15.9 MiB JPEG of COM
     segments and a 15.9 MiB PNG of tiny chunks (bench/hostile_files.py) through the tree's own SDK for
     `--attack-s` (20) seconds, while ListModels calls and the Submits of an ordinary small image are
     timed; then `image_jobs`, `--image-jobs` (24) one-step jobs each with a 15.9 MiB PNG: the
     orchestrator's memory and the database's size after them, and the bytes the store counted.
  jobs: `--jobs` (20) large jobs, `--concurrency` (2) at a time through Generate, each stream read to
     its end: the tiny preset's default size (64x64, 2 steps, CFG) with `--num-frames` 33 and frame
     interpolation at `--interp-exp` 4, (33 - 1) * 2**4 + 1 = 513 frames, 6.3 MB of uint8 frames each.
     Resident memory after they finished, against before, and the peak while they ran. Then replays:
     `--replays` (16) concurrent WatchJob streams of the first of those jobs, each read to its end,
     together with as many concurrent GetJob calls on it; the peak resident memory while they run, against
     before. Twice: `replays_live`, right after the jobs, in the orchestrator process that ran them, and
     `replays_stored`, in a fresh orchestrator process, for which the result exists only in the store.
     The target applies to the stored one.

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
import contextlib
import http.client
import json
import os
import platform
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from hostile_files import chunk_stuffed_png, comment_stuffed_jpeg, padded_png, scan_bomb_jpeg

from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2, generation_pb2_grpc

REPOSITORY = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SAMPLE_INTERVAL_S = 0.01
# A client that sends 16 MiB strings and reads whole results: far above any size used here.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
PROMPT = "a red fox running through fresh snow"
# The tiny preset's default size and steps (families.wan.presets.DEFAULT_REQUESTS["tiny"]).
HEIGHT, WIDTH, STEPS, GUIDANCE = 64, 64, 2, 5.0
# The targets: MiB of memory or database growth, seconds of a call's answer.
TARGETS = {
    "refused_24_delta_mib": 32,
    "refused_96_delta_mib": 32,
    "list_models_max_s": 1.0,
    "image_submit_max_s": 2.0,
    "image_jobs_delta_mib": 64,
    "image_jobs_database_delta_mib": 1,
    "replays_stored_peak_growth_mib": 64,
    "gateway_healthz_max_s": 2.0,
    "gateway_json_peak_growth_mib": 64,
}
SCENARIOS = ("refused", "gateway", "images", "jobs")
SERVE_ORCHESTRATOR = ("stagediff.cli", "serve", "orchestrator")
SERVE_GATEWAY = ("stagediff.cli", "serve", "http")
# The gateway scenario: silent connections held open, the cap on each of its waits, the JSON body's size.
IDLE_CONNECTIONS = 1100
GATEWAY_WAIT_S = 30.0
JSON_BODY_MIB = 64


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


def checked_service(cluster: LocalCluster, name: str, command: tuple[str, ...]) -> str:
    """`name`, checked to be the process running `command` itself (its pid is the process whose memory is read,
    not a wrapper's)."""
    cmdline = Path(f"/proc/{cluster.services[name].pid}/cmdline").read_bytes().split(b"\0")
    if not all(part.encode() in cmdline for part in command):
        raise RuntimeError(f"{name} (pid {cluster.services[name].pid}) does not run `{' '.join(command)}`")
    return name


def orchestrator_name(cluster: LocalCluster) -> str:
    """The cluster's orchestrator service, the `serve orchestrator` process itself."""
    name = next(name for name in cluster.services if cluster.compose[name].is_entry)
    return checked_service(cluster, name, SERVE_ORCHESTRATOR)


def gateway_name(cluster: LocalCluster) -> str:
    """The cluster's HTTP gateway service, the `serve http` process itself."""
    name = next((name for name in cluster.services if cluster.compose[name].is_http), None)
    if name is None:
        raise RuntimeError(f"the cluster of {cluster.compose_file} runs no HTTP gateway")
    return checked_service(cluster, name, SERVE_GATEWAY)


def raise_open_files_limit(needed: int) -> None:
    """Raises this process's soft limit on open files to `needed` (at most the hard limit), before the cluster
    starts: its processes inherit it, so the gateway can take as many connections as are opened to it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


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


def refused_requests(stub, pid: int, count: int, args: argparse.Namespace, deadline: float) -> dict[str, object]:
    """`count` Submit calls, one after another, each with a `--model-mib` MiB model string."""
    codes: Counter[str] = Counter()
    before = rss_mib(pid)
    started = time.perf_counter()
    with PeakWatch(pid) as peak:
        for index in range(count):
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
        "requests": count,
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


def image_attacks(endpoint: str, pid: int, args: argparse.Namespace, deadline: float) -> dict[str, object]:
    """`--attackers` threads send hostile image files (a scan-bomb JPEG, a JPEG of 4-byte COM segments, a PNG of
    12-byte chunks, the last two about 15.9 MiB) through the tree's own SDK for `--attack-s` seconds, while this
    thread times ListModels calls and the Submits of an ordinary small image (each job deleted at once)."""
    from stagediff import Client, StageDiffError

    size = int(15.9 * MIB)
    files = {
        "scan_bomb": scan_bomb_jpeg(4096, 3000),
        "comment_segments": comment_stuffed_jpeg(size // 4),
        "stuffed_chunks": chunk_stuffed_png(size // 12),
    }
    ordinary = padded_png(0, side=HEIGHT)
    codes: dict[str, Counter[str]] = {name: Counter() for name in files}
    stop_at = time.monotonic() + args.attack_s

    def attack(offset: int) -> None:
        with Client(endpoint, timeout=min(120.0, remaining(deadline))) as client:
            index = offset
            while time.monotonic() < stop_at:
                name = list(files)[index % len(files)]
                index += 1
                try:
                    client.submit(PROMPT, image=files[name], num_frames=5, num_inference_steps=1)
                    codes[name]["OK"] += 1
                except StageDiffError as error:
                    codes[name][error.code.name] += 1

    list_models_s: list[float] = []
    submit_s: list[float] = []
    before = rss_mib(pid)
    with PeakWatch(pid) as peak, ThreadPoolExecutor(args.attackers) as pool, Client(endpoint) as client:
        attackers = [pool.submit(attack, offset) for offset in range(args.attackers)]
        time.sleep(0.5)
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            client.list_models()
            list_models_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            job = client.submit(PROMPT, image=ordinary, height=HEIGHT, width=WIDTH, num_frames=5, num_inference_steps=1)
            submit_s.append(time.perf_counter() - started)
            client.delete(job.job_id)
            time.sleep(0.2)
        for future in attackers:
            future.result(timeout=remaining(deadline))
    return {
        "attackers": args.attackers,
        "attack_s": args.attack_s,
        "file_bytes": {name: len(data) for name, data in files.items()},
        "attack_codes": {name: dict(counted) for name, counted in codes.items()},
        "list_models_calls": len(list_models_s),
        "list_models_max_s": round(max(list_models_s), 3),
        "list_models_median_s": round(sorted(list_models_s)[len(list_models_s) // 2], 3),
        "image_submits": len(submit_s),
        "image_submit_max_s": round(max(submit_s), 3),
        "image_submit_median_s": round(sorted(submit_s)[len(submit_s) // 2], 3),
        "rss_before_mib": before,
        "peak_mib": peak.peak_mib,
        "rss_after_mib": rss_mib(pid),
    }


def database_mib(state_dir: Path) -> float:
    """The size of the job database once its write-ahead log is checkpointed into it (SQLite grows the log
    by pages per transaction, whatever the rows hold, until its own checkpoint every 1,000 pages)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(state_dir / "jobs.sqlite3", timeout=30)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return round((state_dir / "jobs.sqlite3").stat().st_size / MIB, 2)


def counted_bytes(state_dir: Path) -> int:
    """The bytes the store counts against the tenants for queued and running jobs (its intermediates)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{state_dir / 'jobs.sqlite3'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT COALESCE(SUM(bytes), 0) FROM intermediates").fetchone()[0]


def image_jobs(
    endpoint: str, pid: int, state_dir: Path, args: argparse.Namespace, deadline: float
) -> dict[str, object]:
    """`--image-jobs` small jobs (1 step, 5 frames), each with a 15.9 MiB PNG (a small image and zeros after its
    end), submitted one after another through the tree's SDK and then waited for; the orchestrator's memory
    and the database's size before and after, and the most bytes the store counted while they were queued."""
    from stagediff import Client

    image = padded_png(int(15.9 * MIB) - len(padded_png(0, side=HEIGHT)), side=HEIGHT)
    before, database_before = rss_mib(pid), database_mib(state_dir)
    counted_most = 0
    with PeakWatch(pid) as peak, Client(endpoint, timeout=min(300.0, remaining(deadline))) as client:
        jobs = []
        for _ in range(args.image_jobs):
            jobs.append(
                client.submit(PROMPT, image=image, height=HEIGHT, width=WIDTH, num_frames=5, num_inference_steps=1)
            )
            counted_most = max(counted_most, counted_bytes(state_dir))
        for job in jobs:
            client.wait(job.job_id)
    time.sleep(args.settle_s)
    after, database_after = rss_mib(pid), database_mib(state_dir)
    return {
        "jobs": args.image_jobs,
        "image_bytes": len(image),
        "rss_before_mib": before,
        "peak_mib": peak.peak_mib,
        "rss_after_mib": after,
        "delta_mib": round(after - before, 1),
        "database_before_mib": database_before,
        "database_after_mib": database_after,
        "database_delta_mib": round(database_after - database_before, 2),
        "counted_bytes_most": counted_most,
        "counted_images_most": round(counted_most / len(image), 2),
    }


# -------------------------------------------------------------------------------------- gateway scenario --


def http_status(address: tuple[str, int], method: str, path: str, body: bytes = b"") -> tuple[int, float]:
    """(status, seconds) of one request without an API key; status 0 where no answer came within GATEWAY_WAIT_S
    (the server may answer and close before it has read a long body: the answer still counts)."""
    connection = http.client.HTTPConnection(*address, timeout=GATEWAY_WAIT_S)
    headers = {"Content-Type": "application/json"} if body else {}
    started = time.perf_counter()
    try:
        with contextlib.suppress(OSError):  # refused midway: the answer may be there already
            connection.request(method, path, body=body or None, headers=headers)
        try:
            status = connection.getresponse().status
        except (OSError, http.client.HTTPException):
            status = 0
    finally:
        connection.close()
    return status, round(time.perf_counter() - started, 3)


def open_silent_connections(address: tuple[str, int], count: int) -> list[socket.socket]:
    """Up to `count` TCP connections that send nothing; fewer where connecting fails or takes GATEWAY_WAIT_S."""
    deadline = time.monotonic() + GATEWAY_WAIT_S
    sockets: list[socket.socket] = []
    while len(sockets) < count and time.monotonic() < deadline:
        try:
            sockets.append(socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())))
        except OSError as error:
            log(f"gateway_idle: connection {len(sockets) + 1} failed: {error}")
            break
    return sockets


def closed_by_server(sockets: list[socket.socket], within_s: float) -> tuple[int, float | None]:
    """How many of `sockets` the server closes (EOF or reset) within `within_s`, and the seconds until the last
    of them closed (None unless all did). Whatever the server sends before closing (a 408) is read and dropped."""
    started = time.monotonic()
    open_count = len(sockets)
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while open_count and time.monotonic() - started < within_s:
            for key, _ in selector.select(timeout=max(0.0, within_s - (time.monotonic() - started))):
                try:
                    closed = key.fileobj.recv(65536) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    selector.unregister(key.fileobj)
                    open_count -= 1
    all_closed_s = round(time.monotonic() - started, 1) if not open_count else None
    return len(sockets) - open_count, all_closed_s


def gateway_idle(address: tuple[str, int]) -> dict[str, object]:
    """IDLE_CONNECTIONS silent connections, then GET /healthz, then how many the server closed."""
    started = time.perf_counter()
    sockets = open_silent_connections(address, IDLE_CONNECTIONS)
    open_s = round(time.perf_counter() - started, 1)
    try:
        healthz_status, healthz_s = http_status(address, "GET", "/healthz")
        closed, all_closed_s = closed_by_server(sockets, GATEWAY_WAIT_S)
    finally:
        for sock in sockets:
            sock.close()
    return {
        "connections": IDLE_CONNECTIONS,
        "opened": len(sockets),
        "open_s": open_s,
        "healthz_status": healthz_status,
        "healthz_s": healthz_s,
        "closed_by_server": closed,
        "closed_within_s": GATEWAY_WAIT_S,
        "all_closed_after_s": all_closed_s,
    }


def many_empty_objects(size: int) -> bytes:
    """`{"a":[{},{},...]}` padded with spaces to exactly `size` bytes: cheap to send, costly to parse."""
    body = b'{"a":[' + b"{}," * ((size - 8) // 3 - 1) + b"{}]}"
    return body + b" " * (size - len(body))


def gateway_json(address: tuple[str, int], pid: int, args: argparse.Namespace) -> dict[str, object]:
    """One JSON_BODY_MIB MiB JSON body posted to /v1/videos without a key: status, seconds and gateway memory."""
    body = many_empty_objects(JSON_BODY_MIB * MIB)
    before = rss_mib(pid)
    with PeakWatch(pid) as peak:
        status, seconds = http_status(address, "POST", "/v1/videos", body)
    time.sleep(args.settle_s)
    return {
        "body_mib": JSON_BODY_MIB,
        "status": status,
        "answer_s": seconds,
        "rss_before_mib": before,
        "peak_mib": peak.peak_mib,
        "peak_growth_mib": round(peak.peak_mib - before, 1),
        "rss_after_mib": rss_mib(pid),
        "peak_from": "VmHWM after reset and sampled VmRSS" if peak.hwm_reset else "sampled VmRSS",
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

    def fresh_orchestrator() -> int:
        """A restarted, warmed orchestrator's pid."""
        pid = restart_orchestrator(cluster, timeout=args.scenario_timeout)
        record_pid(pid)
        channel, _ = fresh_stub()
        channel.close()
        return pid

    def deadline() -> float:
        return time.monotonic() + args.scenario_timeout

    result: dict[str, object] = {"source": args.source, **git_state(Path(args.source))}
    if "gateway" in args.scenarios:
        raise_open_files_limit(IDLE_CONNECTIONS + 1024)
    try:
        cluster.start(timeout=args.scenario_timeout, on_started=lambda service: record_pid(service.pid))
        pid = cluster.services[orchestrator_name(cluster)].pid
        result["imported_from"] = imported_from(pid)
        log(f"{args.source}: cluster up, orchestrator pid {pid}, modules {result['imported_from']}")

        channel, stub = fresh_stub()
        result["baseline_rss_mib"] = rss_mib(pid)
        for count in args.refused:
            result[f"refused_{count}"] = refused_requests(stub, pid, count, args, deadline())
            log(f"refused_{count}: {result[f'refused_{count}']}")
        channel.close()

        if "gateway" in args.scenarios:
            gateway_pid = cluster.services[gateway_name(cluster)].pid
            url = urlsplit(cluster.http_url)
            address = (url.hostname, url.port)
            result["gateway_idle"] = gateway_idle(address)
            log(f"gateway_idle: {result['gateway_idle']}")
            result["gateway_json"] = gateway_json(address, gateway_pid, args)
            log(f"gateway_json: {result['gateway_json']}")

        if "images" in args.scenarios:
            pid = fresh_orchestrator()
            result["image_attacks"] = image_attacks(cluster.endpoint, pid, args, deadline())
            log(f"image_attacks: {result['image_attacks']}")
            pid = fresh_orchestrator()
            result["image_jobs"] = image_jobs(cluster.endpoint, pid, workdir / "state", args, deadline())
            log(f"image_jobs: {result['image_jobs']}")
        if "jobs" not in args.scenarios:
            return result

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
    for name in (
        "model_mib",
        "jobs",
        "concurrency",
        "replays",
        "num_frames",
        "interp_exp",
        "attackers",
        "attack_s",
        "image_jobs",
    ):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--refused", ",".join(map(str, args.refused)), "--scenarios", ",".join(args.scenarios)]
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
    """Each measured value beside its target, and whether it meets it (None where the scenario did not run)."""
    checks = {
        name: (result[f"refused_{count}"]["delta_mib"], TARGETS[name])
        for name, count in ((f"refused_{count}_delta_mib", count) for count in (24, 96) if f"refused_{count}" in result)
    }
    if "image_attacks" in result:
        attacks = result["image_attacks"]
        checks["list_models_max_s"] = (attacks["list_models_max_s"], TARGETS["list_models_max_s"])
        checks["image_submit_max_s"] = (attacks["image_submit_max_s"], TARGETS["image_submit_max_s"])
    if "image_jobs" in result:
        jobs = result["image_jobs"]
        checks["image_jobs_delta_mib"] = (jobs["delta_mib"], TARGETS["image_jobs_delta_mib"])
        checks["image_jobs_database_delta_mib"] = (jobs["database_delta_mib"], TARGETS["image_jobs_database_delta_mib"])
    if "replays_stored" in result:
        stored = result["replays_stored"]["peak_growth_mib"]
        checks["replays_stored_peak_growth_mib"] = (stored, TARGETS["replays_stored_peak_growth_mib"])
    if "gateway_json" in result:
        growth = result["gateway_json"]["peak_growth_mib"]
        checks["gateway_json_peak_growth_mib"] = (growth, TARGETS["gateway_json_peak_growth_mib"])
    table: dict[str, object] = {
        name: {"value": value, "target": target, "meets": value <= target} for name, (value, target) in checks.items()
    }
    if "gateway_idle" in result:
        table |= gateway_idle_targets(result["gateway_idle"])
    if "image_jobs" in result:  # at least one whole image counted while the jobs were queued
        counted = result["image_jobs"]["counted_images_most"]
        table["image_jobs_counted_images_most"] = {"value": counted, "target": ">= 1", "meets": counted >= 1}
    table["all_met"] = all(row["meets"] for row in table.values() if isinstance(row, dict))
    return table


def gateway_idle_targets(idle: dict[str, object]) -> dict[str, object]:
    """/healthz answered 200 within its target while the connections were open; every one closed by the server."""
    status, seconds = idle["healthz_status"], idle["healthz_s"]
    limit = TARGETS["gateway_healthz_max_s"]
    return {
        "gateway_healthz_max_s": {
            "value": seconds,
            "status": status,
            "target": f"200 within {limit} s",
            "meets": status == 200 and seconds <= limit,
        },
        "gateway_idle_closed": {
            "value": idle["closed_by_server"],
            "target": f"all {IDLE_CONNECTIONS} within {GATEWAY_WAIT_S:g} s",
            "meets": idle["opened"] == IDLE_CONNECTIONS and idle["closed_by_server"] == IDLE_CONNECTIONS,
        },
    }


def ratio(after: float, before: float) -> float | None:
    return round(after / before, 3) if before > 0 else None


def comparison(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """Every number of both runs side by side, with after / before."""

    def leaves(result: dict[str, object], prefix: str = "") -> dict[str, float]:
        found: dict[str, float] = {}
        for key, value in result.items():
            if isinstance(value, dict):
                found |= leaves(value, f"{prefix}{key}.")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                found[f"{prefix}{key}"] = value
        return found

    old, new = leaves(before), leaves(after)
    return {
        name: {"before": old[name], "after": new[name], "after_over_before": ratio(new[name], old[name])}
        for name in old
        if name in new and not name.startswith("imported_from")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(REPOSITORY), help="source tree to measure (default: this repository)")
    parser.add_argument("--compare", metavar="OLD_DIR", help="also measure this source tree, first, side by side")
    parser.add_argument("--model", help="tiny checkpoint (default: made with `stagediff init-model --preset tiny`)")
    parser.add_argument(
        "--scenarios",
        type=lambda text: text.split(","),
        default=list(SCENARIOS),
        help=f"which to run, comma-separated, of {','.join(SCENARIOS)} (refused always runs)",
    )
    parser.add_argument("--family", default="wan2.2-ti2v", help="the tiny checkpoint's family (takes text and images)")
    parser.add_argument(
        "--refused",
        type=lambda text: [int(count) for count in text.split(",")],
        default=[24, 96],
        help="refused Submit calls in scenario 1, comma-separated counts, each run in turn",
    )
    parser.add_argument("--attackers", type=int, default=2, help="threads sending hostile images")
    parser.add_argument("--attack-s", type=float, default=20.0, help="seconds the hostile images are sent")
    parser.add_argument("--image-jobs", type=int, default=24, help="jobs with a 15.9 MiB image in scenario images")
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
    if min(*args.refused, args.model_mib, args.jobs, args.concurrency, args.replays, args.attackers) < 1:
        parser.error("--refused, --model-mib, --jobs, --concurrency, --replays and --attackers must be at least 1")
    if not set(args.scenarios) <= set(SCENARIOS):
        parser.error(f"--scenarios: use some of {','.join(SCENARIOS)}")

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
            [sys.executable, "-m", "stagediff.cli", "init-model", "--family", args.family, "--preset", "tiny"]
            + ["--out", str(model)],
            cwd=source,
            env={**os.environ, "PYTHONPATH": str(source)},
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=600,
        )
    output: dict[str, object] = {
        "benchmark": "hostile",
        "family": args.family,
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
