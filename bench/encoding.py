"""Bytes on the wire for one video as raw frames and as the server-encoded MP4, side by side in one run, and how
close the MP4's decoded frames are to the raw ones (PSNR over all frames and pixels).

Starts the local cluster (`stagediff up`'s processes) on a checkpoint, generates the same request (same seed)
with output_format raw, then mp4 at each quality asked for, and counts what the client received: the frames'
bytes for raw, the file's for mp4. The demo model's video (trained: shapes on a plain background) is what
generated video looks like to an encoder; a random-weight preset's is noise, the worst case for any codec.

    python bench/encoding.py [--model DIR | --preset small] [--frames 33] [--quality 65 --quality 80]

With --memory it starts no cluster: it measures the peak memory of one encode of noise (the worst case for any
codec) at the pixel quota (--side 1920: as many frames as the default max_output_pixels allows), mp4 and webm at
each quality, with the encoder's threads and lookahead capped (services/encoding.py) and left to the codec,
each in a fresh process (its peak RSS over what it held before the encoder opened).

    python bench/encoding.py --memory [--side 1920] [--frames N] [--quality 100 --quality 65]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import platform
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import av
import numpy as np

from families.init_model import init_model
from services.encoding import OUTPUT_FORMATS, ResultEncoder
from services.orchestrator.tenants import DEFAULT_MAX_OUTPUT_PIXELS
from stagediff.client import Client, GenerationResult
from stagediff.local.supervisor import LocalCluster


def psnr(reference: np.ndarray, decoded: np.ndarray) -> float:
    error = np.mean((reference.astype(np.float64) - decoded.astype(np.float64)) ** 2)
    return float("inf") if error == 0 else float(10 * np.log10(255.0**2 / error))


def decode(data: bytes, height: int, width: int) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames)[:, :height, :width]  # odd sizes are padded by one row or column for 4:2:0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def encode_peak(name: str, quality: int, side: int, frames: int, capped: bool) -> dict[str, object]:
    """One encode of `frames` noise frames of side x side: its peak RSS growth and time (run in a fresh process)."""
    rng = np.random.default_rng(0)
    before = _rss_bytes()
    bounds = {} if capped else {"threads": None, "lookahead_frames": None}
    encoder = ResultEncoder(OUTPUT_FORMATS[name], quality, side, side, 16.0, **bounds)
    started = time.perf_counter()
    written = 0
    for _ in range(frames):
        frame = np.frombuffer(rng.bytes(side * side * 3), np.uint8).reshape(1, side, side, 3)
        written += len(encoder.add(frame))
    written += len(encoder.finish())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "format": name,
        "quality": quality,
        "capped": capped,
        "peak_growth_mib": round((peak - before) / 2**20, 1),
        "encoded_mib": round(written / 2**20, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }


def memory_report(side: int, frames: int | None, qualities: list[int]) -> dict[str, object]:
    frames = frames or DEFAULT_MAX_OUTPUT_PIXELS // (side * side)
    rows = []
    for quality in qualities:
        for name in ("mp4", "webm"):
            for capped in (False, True):
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    rows.append(pool.submit(encode_peak, name, quality, side, frames, capped).result())
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: a row takes minutes
    return {
        "benchmark": "encoding-memory",
        "frames": [frames, side, side],
        "cpus": os.cpu_count(),
        "rows": rows,
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: a fresh --preset checkpoint)")
    parser.add_argument("--preset", default="small", help="random-weight preset when no --model (default: small)")
    parser.add_argument("--frames", type=int, default=None, help="default: 33; --memory: the pixel quota's")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompt", default="a red circle moving right on a dark background")
    parser.add_argument("--quality", type=int, action="append", help="mp4 qualities (default: 65, the default)")
    parser.add_argument("--memory", action="store_true", help="measure one encode's memory instead (no cluster)")
    parser.add_argument("--side", type=int, default=1920, help="--memory: frame height and width (default: 1920)")
    args = parser.parse_args()
    qualities = args.quality or [65]
    if args.memory:
        print(json.dumps(memory_report(args.side, args.frames, qualities), indent=2))
        return
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(init_model("wan-t2v", args.preset, f"{scratch}/model", seed=0))
        cluster = LocalCluster(model, log_dir=f"{scratch}/logs")
        with cluster, Client(cluster.endpoint, timeout=1800) as client:
            request = dict(num_frames=args.frames or 33, height=args.height, width=args.width, seed=7)
            if args.steps is not None:
                request["num_inference_steps"] = args.steps
            started = time.perf_counter()
            raw: GenerationResult = client.generate(args.prompt, output_format="raw", **request)
            raw_seconds = time.perf_counter() - started
            frames = raw.frames
            rows = []
            for quality in qualities:
                started = time.perf_counter()
                encoded = client.generate(args.prompt, output_format="mp4", output_quality=quality, **request)
                seconds = time.perf_counter() - started
                decoded = decode(encoded.data, frames.shape[1], frames.shape[2])
                rows.append(
                    {
                        "quality": quality,
                        "mp4_bytes": len(encoded.data),
                        "raw_over_mp4": round(frames.nbytes / len(encoded.data), 1),
                        "psnr_db": round(psnr(frames, decoded), 2),
                        "decoded_frames": int(decoded.shape[0]),
                        "job_seconds": round(seconds, 2),
                    }
                )
    print(
        json.dumps(
            {
                "benchmark": "encoding",
                "model": args.model or f"wan-t2v {args.preset} (random weights)",
                "frames": list(frames.shape),
                "raw_bytes": int(frames.nbytes),
                "raw_job_seconds": round(raw_seconds, 2),
                "mp4": rows,
                "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
