"""A real-size checkpoint through loading, the running cluster and the memory guard, in one run.

The checkpoint is init-model's "wan2.1-1.3b-config" preset: Wan2.1-T2V-1.3B-Diffusers' configs and shard
layout with random bf16 weights (a 5.7B UMT5-XXL text encoder in 5 shards, a 1.3B transformer in 2, the
VAE), about 14 GB on disk. The run records, and prints as one JSON object:

  load      per component (text_encoder, transformer, vae), bf16 into bf16 on the CPU, each mode in a fresh
            process with a warm page cache: our loader at 1 and 4 threads against the libraries'
            from_pretrained without and with their parallel loading (the modes and the timing of
            bench/weight_loading.py, which runs them); medians over --repeats and the ratios.
  cluster   the local cluster with every stage in its own process (stagediff.local.LocalCluster, as
            `stagediff up` runs it), every stage in bf16: how long until every stage was SERVING, one small
            request end to end (--width x --height, --frames frames, --steps steps) with the stage times the
            orchestrator reports, and each stage process's peak resident memory (VmHWM in /proc/PID/status,
            with the resident split into anonymous and file-backed pages at the end).
  gguf      the transformer as each --gguf-types type (written as `init-model --gguf` writes it) beside the
            bf16 safetensors one, each loaded by the DiT stage's loader in a fresh process: file bytes, load
            seconds, parameter bytes, peak resident memory, one forward pass at the request's size and its
            noise prediction's relative error against bf16's.
  guard     `stagediff serve text-encoder --dtype float32` on the checkpoint: it must refuse to start with the
            memory guard's message (services/memory_budget.py) rather than be killed. And the Wan2.2-T2V-A14B
            DiT (two 14B experts): its need is computed from the published transformer config on the meta
            device (writing 57 GB of weights does not fit this disk) and checked by the same function the
            stage runs, against this machine's memory.

    python bench/real_size.py [--model DIR] [--keep] [--repeats 1]

--model DIR: the checkpoint there is used when DIR holds one, else it is written there; it is left in place.
Without --model the checkpoint is written to a temporary directory, removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.weight_loading import MODES, run_worker, summarise, warm, weight_files  # noqa: E402
from families.wan.real_size import REAL_TRANSFORMER_CONFIG  # noqa: E402

PRESET = "wan2.1-1.3b-config"
COMPONENTS = {
    "text_encoder": "UMT5EncoderModel",
    "transformer": "WanTransformer3DModel",
    "vae": "AutoencoderKLWan",
}
STAGE_PROCESSES = ("text-encoder", "dit", "vae")
PROMPT = "a red fox running through fresh snow, cinematic"
NEGATIVE = "blurry, low quality"

# transformer/config.json of Wan2.2-T2V-A14B-Diffusers (transformer_2, the low-noise expert, has the same):
# Wan2.1-1.3B's layout at 40 heads x 128, ffn 13824, 40 blocks.
A14B_EXPERT_CONFIG: dict[str, Any] = {
    **REAL_TRANSFORMER_CONFIG,
    "num_attention_heads": 40,
    "ffn_dim": 13824,
    "num_layers": 40,
}


def make_checkpoint(out: Path) -> float:
    """Writes the preset to `out`; returns the seconds it took."""
    from families.init_model import init_model

    started = time.perf_counter()
    init_model("wan-t2v", PRESET, out)
    return time.perf_counter() - started


def checkpoint_layout(model: Path) -> dict[str, Any]:
    """Files, bytes and parameters per component, from the safetensors headers."""
    from safetensors import safe_open

    layout = {}
    for name in COMPONENTS:
        files = weight_files(model / name)
        parameters = 0
        for path in files:
            with safe_open(path, "pt") as opened:
                parameters += sum(math.prod(opened.get_slice(key).get_shape()) for key in opened.keys())  # noqa: SIM118 - not a dict
        layout[name] = {
            "files": len(files),
            "bytes": sum(path.stat().st_size for path in files),
            "parameters": parameters,
        }
    return layout


def measure_loading(model: Path, repeats: int) -> dict[str, Any]:
    """bench/weight_loading.py's four modes on each component, warm page cache, interleaved."""
    results: dict[str, Any] = {}
    for name, model_class in COMPONENTS.items():
        component = model / name
        files = weight_files(component)
        worker_args = argparse.Namespace(model_class=model_class, dtype="bf16")
        samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in MODES:
                warm(files)
                samples[mode].append(run_worker(mode, worker_args, component))
        summary = summarise(samples, samples[MODES[0]][0]["bytes"])
        results[name] = {"model_class": model_class, "bytes": samples[MODES[0]][0]["bytes"], **summary}
        print(f"load {name}: " + json.dumps({m: summary[m]["total_s"] for m in MODES}), file=sys.stderr)
    return results


def process_memory(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def run_cluster(model: Path, request: dict[str, Any], threads: int, logs: Path) -> dict[str, Any]:
    """The cluster on `model` in bf16: startup, one request's stage times, each stage process's peak memory."""
    from stagediff import Client
    from stagediff.local.supervisor import LocalCluster

    bf16 = ["--dtype", "bfloat16"]
    cluster = LocalCluster(
        model,
        threads_per_stage=threads,
        log_dir=logs,
        extra_args={"text-encoder": bf16, "dit": bf16, "vae": bf16},
    )
    started = time.perf_counter()
    cluster.start(timeout=1800)
    startup_s = time.perf_counter() - started
    print(f"cluster SERVING after {startup_s:.1f} s", file=sys.stderr)
    try:
        with Client(cluster.endpoint) as client:
            sent = time.perf_counter()
            result = client.generate(PROMPT, negative_prompt=NEGATIVE, seed=0, timeout=3600, **request)
            request_s = time.perf_counter() - sent
        frames = result.frames
        memory = {
            name: process_memory(service.pid)
            for name, service in cluster.services.items()
            if name in STAGE_PROCESSES or name == "orchestrator"
        }
    finally:
        cluster.stop()
    return {
        "startup_s": round(startup_s, 1),
        "request": request,
        "request_s": round(request_s, 2),
        "stage_s": {stage: round(seconds, 2) for stage, seconds in result.timings.items()},
        "frames_shape": list(frames.shape),
        "memory_bytes": memory,
    }


def fp32_text_encoder_attempt(model: Path) -> dict[str, Any]:
    """`stagediff serve text-encoder --dtype float32`: how it ends and what it says."""
    command = [sys.executable, "-m", "stagediff.cli", "serve", "text-encoder", "--model", str(model)]
    command += ["--dtype", "float32", "--device", "cpu", "--port", "0", "--metrics-port", "0", "--insecure"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    lines = done.stderr.strip().splitlines()
    return {
        "command": "stagediff serve text-encoder --model DIR --dtype float32 --device cpu",
        "exit_code": done.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "message": lines[-1] if lines else "",
    }


def a14b_guard() -> dict[str, Any]:
    """The Wan2.2-A14B DiT's need on this machine's CPU in bf16, and the guard's verdict."""
    import torch
    from diffusers import WanTransformer3DModel

    from dit_svc.service import GGUF_FIX
    from services.memory_budget import MemoryBudgetError, WeightNeed, available_bytes, check_weights_fit

    with torch.device("meta"):
        expert = WanTransformer3DModel(**A14B_EXPERT_CONFIG)
    keep_fp32 = set(WanTransformer3DModel._keep_in_fp32_modules)
    expert_bytes = sum(
        tensor.numel() * (4 if keep_fp32.intersection(key.split(".")) else 2)
        for key, tensor in expert.state_dict().items()
    )
    experts = {"transformer": expert_bytes, "transformer_2": expert_bytes}
    need = WeightNeed("dit", torch.device("cpu"), torch.bfloat16, experts, fixes=[GGUF_FIX])
    available = available_bytes(torch.device("cpu"))
    # What the fix would need (an estimate: no A14B GGUF file is written here): Q4_0 stores 32 weights in 18 bytes.
    parameters = sum(tensor.numel() for tensor in expert.state_dict().values())
    q4_0 = WeightNeed("dit", torch.device("cpu"), torch.bfloat16, dict.fromkeys(experts, parameters * 18 // 32))
    try:
        check_weights_fit(need, available)
        message = None
    except MemoryBudgetError as error:
        message = f"stagediff serve dit: {error}"
    return {
        "expert_parameters": parameters,
        "expert_bytes_bf16": expert_bytes,
        "need_bytes": need.total_bytes,
        "available_bytes": available[0],
        "fits": message is None,
        "message": message,
        "gguf_q4_0_need_bytes_estimate": q4_0.total_bytes,
        "gguf_q4_0_fits_estimate": q4_0.total_bytes <= available[0],
    }


def _transformer_worker(model: str, gguf: bool, latent_shape: tuple[int, ...], threads: int) -> dict[str, Any]:
    """In a fresh process: the transformer loaded as the DiT stage loads it in bf16 (from `model`'s GGUF file, or
    its safetensors), its load seconds, parameter bytes and peak resident memory, and one CFG-less noise
    prediction on seeded inputs of the request's size."""
    import torch
    from diffusers import WanTransformer3DModel

    from dit_svc.quantization import parameter_bytes
    from stagekit.gguf import load_gguf_transformer
    from stagekit.weights import load_pretrained

    torch.set_num_threads(threads)
    component, cpu = Path(model) / "transformer", torch.device("cpu")
    started = time.perf_counter()
    if gguf:
        transformer = load_gguf_transformer(WanTransformer3DModel, component, device=cpu, dtype=torch.bfloat16)
    else:
        transformer = load_pretrained(WanTransformer3DModel, component, device=cpu, dtype=torch.bfloat16)
    load_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(latent_shape, generator=generator).to(torch.bfloat16),
        timestep=torch.tensor([900]),
        encoder_hidden_states=torch.randn(1, 512, transformer.config.text_dim, generator=generator).to(torch.bfloat16),
        return_dict=False,
    )
    started = time.perf_counter()
    with torch.no_grad():
        prediction = transformer(**inputs)[0].float()
    return {
        "load_s": round(load_s, 2),
        "parameter_bytes": parameter_bytes(transformer),
        "forward_s": round(time.perf_counter() - started, 2),
        "peak_rss_bytes": process_memory(os.getpid())["VmHWM"],
        "prediction": prediction,
    }


def _in_fresh_process(function: Any, *args: Any) -> Any:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def measure_gguf(model: Path, quant_types: list[str], request: dict[str, Any], threads: int) -> dict[str, Any]:
    """The transformer as each GGUF type (written by families/gguf.py, as `init-model --gguf` writes it, loaded
    by the DiT stage's loader) beside the bf16 safetensors one, each in a fresh process: file bytes, write and
    load seconds, parameter bytes, peak resident memory, one forward pass, and how far its noise prediction is
    from the bf16 one (relative L2 error) on the same inputs."""
    from families.gguf import gguf_file_name, original_names, write_gguf
    from families.registry import FAMILIES

    latent_shape = (1, 16, (request["num_frames"] - 1) // 4 + 1, request["height"] // 8, request["width"] // 8)
    reference = _in_fresh_process(_transformer_worker, str(model), False, latent_shape, threads)
    expected = reference.pop("prediction")
    results: dict[str, Any] = {"bf16 safetensors": reference}
    work = Path(tempfile.mkdtemp(prefix="stagediff-real-size-gguf-"))
    try:
        for quant_type in quant_types:
            # A checkpoint of its own: the index and the transformer's config beside the GGUF file.
            checkpoint = work / quant_type
            (checkpoint / "transformer").mkdir(parents=True)
            shutil.copy(model / "model_index.json", checkpoint)
            shutil.copy(model / "transformer" / "config.json", checkpoint / "transformer")
            out = checkpoint / "transformer" / gguf_file_name(quant_type)
            started = time.perf_counter()
            write_gguf(model / "transformer", quant_type, original_names(FAMILIES["wan-t2v"]), "wan", out=out)
            write_s = time.perf_counter() - started
            run = _in_fresh_process(_transformer_worker, str(checkpoint), True, latent_shape, threads)
            prediction = run.pop("prediction")
            error = ((prediction - expected).norm() / expected.norm()).item()
            results[f"gguf {quant_type}"] = {
                "file_bytes": out.stat().st_size,
                "write_s": round(write_s, 1),
                **run,
                "parameter_bytes_vs_bf16": round(run["parameter_bytes"] / reference["parameter_bytes"], 4),
                "prediction_relative_error_vs_bf16": round(error, 5),
            }
            print(f"gguf {quant_type}: " + json.dumps(results[f"gguf {quant_type}"]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the checkpoint's directory: used if it holds one, else written")
    parser.add_argument("--keep", action="store_true", help="leave the temporary checkpoint in place")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each loading mode per component")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads per stage")
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--gguf-types", default="Q8_0,Q4_0", help="GGUF types of the transformer to measure")
    parser.add_argument("--skip", nargs="*", default=[], choices=["load", "cluster", "guard", "gguf"])
    args = parser.parse_args()
    temporary = None
    report: dict[str, Any] = {
        "benchmark": "real_size",
        "preset": PRESET,
        "machine": {
            "cpus": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "platform": platform.platform(),
        },
    }
    if args.model:
        model = args.model
    else:
        model = Path(tempfile.mkdtemp(prefix="stagediff-real-size-")) / PRESET
        temporary = None if args.keep else model.parent
    report["model"] = str(model)
    if not (model / "model_index.json").is_file():
        report["write_s"] = round(make_checkpoint(model), 1)
    try:
        report["checkpoint"] = checkpoint_layout(model)
        if "load" not in args.skip:
            report["load"] = measure_loading(model, args.repeats)
        if "cluster" not in args.skip:
            request = dict(width=args.width, height=args.height, num_frames=args.frames, num_inference_steps=args.steps)
            logs = Path(tempfile.mkdtemp(prefix="stagediff-real-size-logs-"))
            report["cluster"] = run_cluster(model, request, args.threads, logs)
            report["cluster"]["logs"] = str(logs)
        if "gguf" not in args.skip:
            request = dict(width=args.width, height=args.height, num_frames=args.frames)
            report["gguf"] = measure_gguf(model, args.gguf_types.split(","), request, args.threads)
        if "guard" not in args.skip:
            report["guard"] = {"text_encoder_fp32": fp32_text_encoder_attempt(model), "wan2.2_a14b_dit": a14b_guard()}
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    report["summary"] = summary(report)
    print(json.dumps(report, indent=2))


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The side-by-side numbers: load seconds per mode and ratios, peak memory and seconds per stage."""
    out: dict[str, Any] = {}
    for name, load in report.get("load", {}).items():
        out[f"load_s {name}"] = {mode: load[mode]["total_s"] for mode in MODES}
        out[f"load_ratio {name}"] = load["speedup"]
    cluster = report.get("cluster")
    if cluster:
        out["peak_rss_gb"] = {name: round(m["VmHWM"] / 1e9, 2) for name, m in cluster["memory_bytes"].items()}
        out["stage_s"] = cluster["stage_s"]
    if "write_s" in report:
        out["write_s"] = report["write_s"]
    return out


if __name__ == "__main__":
    main()
