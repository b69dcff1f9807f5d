"""Bytes on the wire for one video as raw frames and as the server-encoded MP4, side by side in one run, and how
close the MP4's decoded frames are to the raw ones (PSNR over all frames and pixels).

Starts the local cluster (`stagediff up`'s processes) on a checkpoint, generates the same request (same seed)
with output_format raw, then mp4 at each quality asked for, and counts what the client received: the frames'
bytes for raw, the file's for mp4. The demo model's video (trained: shapes on a plain background) is what
generated video looks like to an encoder; a random-weight preset's is noise, the worst case for any codec.

    python bench/encoding.py [--model DIR | --preset small] [--frames 33] [--quality 65 --quality 80]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import tempfile
import time

import av
import numpy as np

from families.init_model import init_model
from stagediff.client import Client, GenerationResult
from stagediff.local.supervisor import LocalCluster


def psnr(reference: np.ndarray, decoded: np.ndarray) -> float:
    error = np.mean((reference.astype(np.float64) - decoded.astype(np.float64)) ** 2)
    return float("inf") if error == 0 else float(10 * np.log10(255.0**2 / error))


def decode(data: bytes, height: int, width: int) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames)[:, :height, :width]  # odd sizes are padded by one row or column for 4:2:0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: a fresh --preset checkpoint)")
    parser.add_argument("--preset", default="small", help="random-weight preset when no --model (default: small)")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompt", default="a red circle moving right on a dark background")
    parser.add_argument("--quality", type=int, action="append", help="mp4 qualities (default: 65, the default)")
    args = parser.parse_args()
    qualities = args.quality or [65]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(init_model("wan-t2v", args.preset, f"{scratch}/model", seed=0))
        cluster = LocalCluster(model, log_dir=f"{scratch}/logs")
        with cluster, Client(cluster.endpoint, timeout=1800) as client:
            request = dict(num_frames=args.frames, height=args.height, width=args.width, seed=7)
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
