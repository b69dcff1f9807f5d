"""VAE decode time and peak memory per rank: 1 rank against 2 patch-parallel ranks, in one run.

Each configuration runs in fresh spawned processes with one intra-op thread per
rank. A rank's peak memory is its peak resident set during the decodes (sampled
every millisecond) minus its resident set just before (model loaded, latents
made): the activations and causal caches the decode needs, which is what patch
parallelism spreads.

    python bench/vae_scaling.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from families.init_model import init_model
from families.wan.decode import WanStreamingDecoder
from families.wan.presets import DEFAULT_REQUESTS
from stagekit.parallel.launch import run_ranks
from vae_svc.patch_parallel import PatchParallelDecodeSession


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's resident set every millisecond while active; the lifetime peak
    (ru_maxrss) would include model loading and imports."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _decode(rank: int, world_size: int, model: str, shape: tuple[int, ...], repeats: int) -> dict:
    decoder = WanStreamingDecoder(model, torch.device("cpu"), torch.float32)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    seconds = []
    before = _rss_bytes()
    with PeakRss() as rss:
        for _ in range(repeats + 1):  # the first decode is a warm-up
            session = decoder.session() if world_size == 1 else PatchParallelDecodeSession(decoder, output_rank=0)
            started = time.perf_counter()
            for t in range(shape[2]):
                session.decode_next(latents[:, :, t : t + 1])
            seconds.append(time.perf_counter() - started)
    return {"seconds": seconds[1:], "peak_bytes": max(rss.peak - before, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--model", help="existing checkpoint (default: make one with init-model)")
    parser.add_argument("--size", type=int, nargs=3, metavar=("H", "W", "FRAMES"), help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(init_model("wan-t2v", args.preset, Path(tempfile.mkdtemp()) / args.preset))
    request = DEFAULT_REQUESTS[args.preset]
    height, width, frames = args.size or (request["height"], request["width"], request["num_frames"])
    shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)

    one = run_ranks(_decode, 1, model, shape, args.repeats)
    two = run_ranks(_decode, 2, model, shape, args.repeats)
    one_s = statistics.median(one[0]["seconds"])
    two_s = statistics.median(two[0]["seconds"])
    mib = 1 << 20
    print(
        json.dumps(
            {
                "benchmark": "vae_scaling",
                "preset": args.preset,
                "video": {"height": height, "width": width, "num_frames": frames, "latent_shape": list(shape)},
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "threads_per_rank": 1,
                "one_rank": {"decode_s": round(one_s, 3), "peak_mib": round(one[0]["peak_bytes"] / mib, 1)},
                "two_ranks": {
                    "decode_s": round(two_s, 3),
                    "speedup": round(one_s / two_s, 2),
                    "peak_mib_per_rank": [round(r["peak_bytes"] / mib, 1) for r in two],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
