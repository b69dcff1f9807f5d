"""Weight loading time: `stagekit.weights.load_pretrained` against diffusers `from_pretrained`, in one run.

Four modes, each in a fresh process (imports done before the clock starts):
    ours-1              load_pretrained(num_threads=1)
    ours-4              load_pretrained(num_threads=4)
    diffusers           Class.from_pretrained(dir, torch_dtype=...)
    diffusers-parallel  the same with HF_ENABLE_PARALLEL_LOADING=yes (diffusers reads this at import, so
                        only a fresh process sees it; the worker checks that diffusers picked it up)

--model-class may also name a transformers class (UMT5EncoderModel): the two library modes are then
transformers' own from_pretrained with its threaded loading switched off (HF_DEACTIVATE_ASYNC_LOAD=1) for
"diffusers", and as it ships (threads on) for "diffusers-parallel".

Weights diffusers does not cast stay views into the mmap-ed files: `from_pretrained` returns before
most bytes are read, and the reads happen as page faults on first use. So every mode is timed to the
point where every weight is in memory: the call, then one byte of every page of every tensor is
read ("touch"). `total_s` (call + touch) is the number compared; `load_s` is shown too.

Each mode runs with a warm page cache (the files read once just before) and a cold one (page cache
dropped with `echo 1 > /proc/sys/vm/drop_caches`, which needs root; without it cold is reported as
not measurable). Modes are interleaved and repeated; medians are reported.

Without --model a WanTransformer3DModel checkpoint of about 1.1 GB (fp32, random weights) is written
to a temporary directory in 13 shards and removed afterwards.

    python bench/weight_loading.py [--model DIR] [--repeats 3] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from families.wan.real_size import REAL_TRANSFORMER_CONFIG

REPO = Path(__file__).resolve().parent.parent
MODES = ("ours-1", "ours-4", "diffusers", "diffusers-parallel")
OURS = ("ours-1", "ours-4")
DIFFUSERS = ("diffusers", "diffusers-parallel")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

# A Wan2.1-1.3B-wide DiT (dim 1536, 12 heads, ffn 8960, text 4096) cut to 6 blocks: about 1.1 GB in fp32.
BIG_TRANSFORMER: dict[str, Any] = {**REAL_TRANSFORMER_CONFIG, "num_layers": 6}
SHARD_SIZE = 120 * 10**6  # bytes; gives 13 shards for the checkpoint above


def make_checkpoint(out: Path) -> Path:
    """A random-weight WanTransformer3DModel of about 1.1 GB saved in >= 8 safetensors shards."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**BIG_TRANSFORMER).eval()
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    del model
    return out


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def warm(files: list[Path]) -> None:
    """Read every file once so that the page cache holds it."""
    buffer = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def drop_page_cache() -> str | None:
    """Empty the page cache; the reason it cannot be done here, or None when it was."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as error:
        return f"cannot drop the page cache ({error}); needs root and a writable /proc/sys"
    return None


def resident_fraction(files: list[Path]) -> float | None:
    """Fraction of the files' bytes in the page cache, from util-linux `fincore` where it exists."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *map(str, files)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    resident = size = 0
    for line in out.split("\n"):
        if line.strip():
            res, total = line.split()
            resident, size = resident + int(res), size + int(total)
    return min(1.0, resident / size) if size else None  # RES counts whole pages


# ---------------------------------------------------------------------------------------------
# The measured process.


def worker(mode: str, model_dir: Path, model_class: str, dtype_name: str) -> dict[str, Any]:
    """Load once in this fresh process and return the timings; imports happen before the clock."""
    import diffusers
    import torch
    from diffusers.utils import constants

    from stagekit.weights import load_pretrained, load_stats

    cls = model_class_named(model_class)
    dtype = getattr(torch, dtype_name)
    if hasattr(diffusers, model_class):
        parallel = constants.HF_ENABLE_PARALLEL_LOADING
        if mode in DIFFUSERS and parallel is not (mode == "diffusers-parallel"):
            raise RuntimeError(f"{mode}: diffusers sees HF_ENABLE_PARALLEL_LOADING={parallel}")
    else:
        from transformers.utils import is_env_variable_true

        parallel = not is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD")
        if mode in DIFFUSERS and parallel is not (mode == "diffusers-parallel"):
            raise RuntimeError(f"{mode}: transformers sees HF_DEACTIVATE_ASYNC_LOAD={not parallel}")

    start = time.perf_counter()
    if mode in OURS:
        model = load_pretrained(cls, model_dir, device="cpu", dtype=dtype, num_threads=int(mode.split("-")[1]))
    else:
        model = cls.from_pretrained(model_dir, torch_dtype=dtype)
    loaded = time.perf_counter()
    page = os.sysconf("SC_PAGE_SIZE")
    checksum = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            checksum += int(flat[::page].sum())
    touched = time.perf_counter()

    state = model.state_dict()
    info: dict[str, Any] = {
        "load_s": loaded - start,
        "touch_s": touched - loaded,
        "total_s": touched - start,
        "bytes": unique_bytes(state),
        "checksum": checksum,
        "mmap_backed": _mapped_safetensors(),
    }
    if mode in OURS:
        info["read_bytes"] = load_stats(model).total_bytes
    return info


def unique_bytes(state: dict[str, Any]) -> int:
    """Bytes of a state dict's tensors, a tensor shared under several keys (tied embeddings) counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in state.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def model_class_named(name: str) -> type:
    """A diffusers model class, else a transformers one, by name."""
    import diffusers

    if hasattr(diffusers, name):
        return getattr(diffusers, name)
    import transformers

    return getattr(transformers, name)


def _mapped_safetensors() -> int:
    """How many mappings of safetensors files this process holds (weights left as mmap views)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if ".safetensors" in line)


def run_worker(mode: str, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("HF_ENABLE_PARALLEL_LOADING", None)
    env.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
    if mode == "diffusers-parallel":
        env["HF_ENABLE_PARALLEL_LOADING"] = "yes"
    if mode == "diffusers":
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # transformers' threaded loading off (diffusers ignores it)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--worker", mode, "--model", str(model_dir)]
    command += ["--model-class", args.model_class, "--dtype", args.dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The driver.


def summarise(samples: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for mode, runs in samples.items():
        totals = [r["total_s"] for r in runs]
        result[mode] = {
            "total_s": round(statistics.median(totals), 4),
            "best_s": round(min(totals), 4),
            "load_s": round(statistics.median(r["load_s"] for r in runs), 4),
            "touch_s": round(statistics.median(r["touch_s"] for r in runs), 4),
            "gb_per_s": round(nbytes / statistics.median(totals) / 1e9, 3),
            "total_s_runs": [round(t, 4) for t in totals],
            "mmap_backed_files": runs[-1]["mmap_backed"],
        }
    ratios = {}
    for ours in OURS:
        for theirs in DIFFUSERS:
            # > 1 means ours is faster.
            ratios[f"{theirs} / {ours}"] = round(result[theirs]["total_s"] / result[ours]["total_s"], 3)
    result["speedup"] = ratios
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="component folder (config.json + safetensors); default: make one")
    parser.add_argument(
        "--model-class", default="WanTransformer3DModel", help="diffusers (or transformers) class of --model"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype to load into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.model_class, DTYPES[args.dtype])))
        return

    with tempfile.TemporaryDirectory(prefix="weight-bench-") as tmp:
        model_dir = args.model or make_checkpoint(Path(tmp) / "transformer")
        files = weight_files(model_dir)
        file_bytes = sum(p.stat().st_size for p in files)

        conditions = ["warm"] + ([] if args.no_cold else ["cold"])
        cold_note = None
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in args.modes} for c in conditions}
        residency: dict[str, list[float | None]] = {c: [] for c in conditions}
        for _ in range(args.repeats):
            for condition in conditions:
                if condition == "cold" and cold_note is not None:
                    continue
                for mode in args.modes:
                    if condition == "warm":
                        warm(files)
                    else:
                        cold_note = drop_page_cache()
                        if cold_note is not None:
                            break
                    residency[condition].append(resident_fraction(files))
                    samples[condition][mode].append(run_worker(mode, args, model_dir))

        nbytes = samples["warm"][args.modes[0]][0]["bytes"]
        report: dict[str, Any] = {
            "benchmark": "weight_loading",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "model": str(args.model) if args.model else f"WanTransformer3DModel {BIG_TRANSFORMER} (random)",
            "model_class": args.model_class,
            "dtype": args.dtype,
            "files": len(files),
            "file_bytes": file_bytes,
            "model_bytes": nbytes,
            "repeats": args.repeats,
            "metric": "median seconds from the call to every weight page resident (load + touch)",
        }
        for condition in conditions:
            if condition == "cold" and cold_note is not None:
                report["cold"] = {"not_measurable": cold_note}
                continue
            report[condition] = summarise(samples[condition], nbytes)
            fractions = [f for f in residency[condition] if f is not None]
            if fractions:
                report[condition]["page_cache_resident_before_min_max"] = [
                    round(min(fractions), 3),
                    round(max(fractions), 3),
                ]
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
