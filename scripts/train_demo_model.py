"""Trains the demo model on the shape world and writes it as a diffusers checkpoint.

    python scripts/train_demo_model.py --out /tmp/demo --seed 0 --vae-from shapeworld/checkpoint  # the committed one
    python scripts/train_demo_model.py --out /tmp/demo --seed 0      # every phase, the autoencoder too
    python scripts/train_demo_model.py --out /tmp/demo --quick       # a few steps of every phase

A progress bar per phase on stderr; every 25th step's losses (and every step with --quick) go to
OUT/training_log.jsonl as they come, and OUT/training.json records the command, seed, wall time per phase
and the final losses. What is trained and how: shapeworld/demo_model.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shapeworld.demo_model import QUICK_DIT, QUICK_VAE, train  # noqa: E402
from shapeworld.train_dit import DitSchedule  # noqa: E402
from shapeworld.train_vae import VaeSchedule  # noqa: E402

LOG_EVERY = 25


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument(
        "--vae-from",
        type=Path,
        help="keep this checkpoint's trained autoencoder (its latent statistics recomputed), train the rest",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of each phase (checks the script runs)")
    args = parser.parse_args()
    if args.vae_from is not None:
        missing = [name for name in ("vae", "training.json") if not (args.vae_from / name).exists()]
        if missing:
            parser.error(f"--vae-from {args.vae_from}: not a trained demo checkpoint (no {' or '.join(missing)})")
    torch.set_num_threads(args.threads)
    vae_schedule, dit_schedule = (QUICK_VAE, QUICK_DIT) if args.quick else (VaeSchedule(), DitSchedule())
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "training_log.jsonl"
    every = 1 if args.quick else LOG_EVERY
    bars: dict[str, tqdm] = {}

    with log_path.open("w") as log:

        def on_progress(phase: str, step: int, total: int, losses: dict[str, float]) -> None:
            bar = bars.get(phase)
            if bar is None:
                bar = bars[phase] = tqdm(total=total, desc=phase, unit="step" if losses else "scene", leave=True)
            bar.update(step - bar.n)
            if losses:
                bar.set_postfix({name: f"{value:.4f}" for name, value in losses.items()}, refresh=False)
                if step % every == 0 or step == total:
                    log.write(json.dumps({"phase": phase, "step": step, **losses}) + "\n")
                    log.flush()
            if step == total:
                bar.close()

        record = train(
            args.out,
            seed=args.seed,
            vae_schedule=vae_schedule,
            dit_schedule=dit_schedule,
            on_progress=on_progress,
            command=shlex.join(["python", "scripts/train_demo_model.py", *sys.argv[1:]]),
            vae_from=args.vae_from,
        )
    print(json.dumps({"out": str(args.out), **{k: record[k] for k in ("wall_seconds", "final_losses")}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
