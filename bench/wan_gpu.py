"""Wan2.1-T2V-1.3B at real size on one GPU: our DiT and our cluster against diffusers' WanPipeline, in one run.

The checkpoint is the real Wan2.1-T2V-1.3B configs with random bf16 weights, written by
`init_model("wan-t2v", "wan2.1-1.3b-config", ...)` into a temporary directory (about 14 GB), so a fresh GPU
machine needs nothing else. Everything runs in bf16 on one CUDA GPU, with diffusers' "native" attention
backend (torch.nn.functional.scaled_dot_product_attention, which picks its own kernel) set explicitly on
every side: `set_attention_backend("native")` on the transformers in this process, DIFFUSERS_ATTN_BACKEND=native
in the environment of the cluster's processes. Sections, each with its peak memory:

- step_time: seconds per denoising step (CFG on: two transformer passes per step) of the DiT stage's
  denoiser, as the stage builds it (`make_denoiser`: the family's denoiser class from the registry) and runs
  it (`denoise_request`), against diffusers' WanTransformer3DModel of the same checkpoint called by
  WanPipeline itself (prompt embeddings in, latents out). The same 512-token random embeddings on both
  sides; each side runs a one-step request first, and the first step of the timed run is left out of the
  median as well.
- step_caches: one request with each step cache the family offers (first_block, mag, teacache at the
  stage's default thresholds; MagCache's ratios calibrated first on another seed, as `stagediff
  calibrate-cache` does), against the same request uncached: denoising seconds, passes run and skipped.
- compile: the same denoiser built with `--compile` (regional compilation): the first request (which
  compiles the blocks) and the median step of the next one.
- end_to_end: one request, prompt to frames, through the whole cluster on one GPU
  (deploy/docker-compose.single-gpu.yml run as local processes, as `stagediff up` does) against
  WanPipeline in this process (every component bf16, as the cluster's stages run on a GPU), each after a
  one-step warm-up request of the same size.

Memory: in this process torch.cuda.max_memory_allocated over the measured request, and its excess over what
was allocated before it (WanPipeline holds its text encoder and VAE besides the transformer, our denoiser the
transformer alone: compare the excess); for the two end-to-end paths also the device's used memory
(torch.cuda.mem_get_info: every process on the GPU), sampled every 0.1 s from before loading to the end of
the request, over what was used before. On the CPU (--dry-run) the same figures are resident memory: this
process's peak (VmHWM, reset before each request) and the sampled resident memory of the process(es) doing
the work.

Sizes: the default is the reference request, 832x480, 81 frames, 50 steps, CFG 5.0; `--quick` keeps the
size and frames (so step_time, which always times the same 6-step run, is the same measurement in both)
and runs 10 steps in the other sections, to fit a 10-minute window on an H100 with the checkpoint write.
`--dry-run` runs every section on the CPU with the tiny preset at its size, 2 steps, float32 (the
cluster on the same single-GPU compose file, whose stages then pick the CPU), in well under a minute;
tests/e2e/test_bench_wan_gpu.py runs it. Without CUDA and without --dry-run the script stops with an error.

The JSON records the published figures to compare with (ANCHORS) and, for a run of their size, our
seconds over theirs; the device and the torch, diffusers and transformers versions; the checkpoint's
transformer config; and the ratios ours / diffusers. Prints the JSON (and writes it to --out).

    python bench/wan_gpu.py [--quick] [--out FILE] [--model DIR]
    python bench/wan_gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import diffusers
import numpy as np
import torch
import torch._dynamo
import transformers
from diffusers import WanPipeline

# bench/ is the script's directory: MagCache's calibration and the device synchronisation of the step cache
# benchmark.
from step_cache import calibrate, synchronize

from dit_svc.compile import repeated_blocks
from dit_svc.config import DenoiserBuild
from dit_svc.denoise import denoise_request, make_denoiser
from dit_svc.model_options import ModelOptions
from families.base import CACHE_FEATURES, DEFAULT_CACHE_THRESHOLDS
from families.init_model import init_model
from services.checkpoint import read_checkpoint
from stagediff import Client
from stagediff.local.supervisor import PACKAGE_ROOT, LocalCluster
from stagekit.denoise import CacheSpec, DenoiseSpec

REAL_PRESET = "wan2.1-1.3b-config"  # Wan2.1-T2V-1.3B's configs, random bf16 weights
DRY_RUN_PRESET = "tiny"
COMPOSE_FILE = PACKAGE_ROOT / "deploy" / "docker-compose.single-gpu.yml"
ATTENTION_BACKEND = "native"  # diffusers' name for torch.nn.functional.scaled_dot_product_attention
PROMPT = "A red fox trots across a snowy field at dawn, its breath rising in small white clouds, cinematic lighting"
NEGATIVE_PROMPT = "blurry, low quality, static, watermark, text, worst quality"
# The warm-up requests' texts differ from the measured ones, so that the text encoder stage's embedding cache
# does not answer the measured request.
WARM_UP_PROMPT = "A blue whale glides through deep water, sunlight falling in shifting ribbons"
WARM_UP_NEGATIVE_PROMPT = "dark, noisy, low contrast"
SEED = 0
GUIDANCE_SCALE = 5.0
TEXT_LENGTH = 512  # WanPipeline's max_sequence_length: the text encoder stage pads to it as well
SAMPLE_SECONDS = 0.1
# On the CPU (--dry-run) this process and each stage process compute on one intra-op thread: threads of several
# processes spinning on the same few cores stall one another.
CPU_THREADS = 1


@dataclass(frozen=True)
class Mode:
    preset: str
    height: int
    width: int
    num_frames: int
    steps: int  # steps of the step_caches and end_to_end requests
    timing_steps: int  # steps of the step_time and compile runs (the first step of each is left out)
    device: str
    dtype: str


MODES = {
    "full": Mode(
        REAL_PRESET, height=480, width=832, num_frames=81, steps=50, timing_steps=6, device="cuda", dtype="bf16"
    ),
    "quick": Mode(
        REAL_PRESET, height=480, width=832, num_frames=81, steps=10, timing_steps=6, device="cuda", dtype="bf16"
    ),
    "dry-run": Mode(
        DRY_RUN_PRESET, height=64, width=64, num_frames=9, steps=2, timing_steps=2, device="cpu", dtype="fp32"
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Published generation times of Wan2.1-T2V-1.3B, with what their sources state of the request and device.
ANCHORS = (
    {
        "source": "FastVideo",
        "what": "Wan2.1-T2V-1.3B, eager",
        "device": "NVIDIA A100",
        "height": 480,
        "width": 832,
        "num_frames": 81,
        "steps": 50,
        "seconds": 259.7,
    },
    {
        "source": "LightX2V",
        "what": "Wan T2V 1.3B, 480p",
        "device": "NVIDIA H200",
        "height": 480,
        "seconds": 58.0,
    },
)


# ---------------------------------------------------------------------------------------------
# Memory


def reset_peak(device: torch.device) -> int:
    """Starts a new peak (the allocator's on CUDA, the process's resident peak VmHWM on the CPU) and returns the
    memory in use now: the weights and whatever else is resident before the run."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current resident size
    return _status_kib(os.getpid(), "VmRSS") * 1024


def peak(device: torch.device, before: int) -> dict:
    """The peak since reset_peak, and its excess over what was in use then (the run's own memory)."""
    if device.type == "cuda":
        measure, value = "torch.cuda.max_memory_allocated", torch.cuda.max_memory_allocated(device)
    else:
        measure, value = "peak resident memory of this process (VmHWM)", _status_kib(os.getpid(), "VmHWM") * 1024
    return {"measure": measure, "bytes": value, "before_bytes": before, "over_before_bytes": value - before}


def _status_kib(pid: int, field: str) -> int:
    """A /proc/PID/status figure in KiB; 0 for a process that has gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class MemorySampler:
    """The peak of the memory in use while a block runs, sampled every SAMPLE_SECONDS on a thread.

    On CUDA the device's used memory as the driver reports it (torch.cuda.mem_get_info: every process on the
    GPU, this one's context and cache included); on the CPU the summed resident memory of the processes
    `pids()` names at each sample. The baseline is the first sample, taken on entering the block.
    """

    def __init__(self, device: torch.device, pids: Callable[[], list[int]]) -> None:
        self.device = device
        self.pids = pids
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="memory-sampler", daemon=True)

    def used(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free
        return sum(_status_kib(pid, "VmRSS") for pid in self.pids()) * 1024

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> MemorySampler:
        self.baseline = self.peak = self.used()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())

    def report(self) -> dict:
        if self.device.type == "cuda":
            measure = f"device used memory (torch.cuda.mem_get_info), sampled every {SAMPLE_SECONDS} s"
        else:
            measure = f"resident memory of the working processes (VmRSS), sampled every {SAMPLE_SECONDS} s"
        return {
            "measure": measure,
            "peak_bytes": self.peak,
            "baseline_bytes": self.baseline,
            "peak_over_baseline_bytes": self.peak - self.baseline,
        }


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Timing


def timed_run(device: torch.device, run: Callable[[Callable[[], None]], object]) -> tuple[dict, object]:
    """Runs `run(stamp)`, which calls stamp() after each denoising step; returns the timings, the peak memory
    of the run and what `run` returned. Each stamp waits for the device, so that a step's queued kernels count."""
    stamps: list[float] = []

    def stamp() -> None:
        synchronize(device)
        stamps.append(time.perf_counter())

    free_memory(device)
    before = reset_peak(device)
    stamp()
    result = run(stamp)
    synchronize(device)
    finished = time.perf_counter()
    steps = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    timed = steps[1:] or steps  # the first step is the warm-up: allocator, kernel selection
    summary = {
        "request_s": round(finished - stamps[0], 4),
        "step_s": round(statistics.median(timed), 4),
        "steps_s": [round(step, 4) for step in steps],
        "peak_memory": peak(device, before),
    }
    return summary, result


def spec_of(mode: Mode, steps: int, cache: CacheSpec | None = None) -> DenoiseSpec:
    return DenoiseSpec(
        height=mode.height,
        width=mode.width,
        num_frames=mode.num_frames,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE_SCALE,
        seed=SEED,
        cache=cache or CacheSpec(),
    )


def random_embeddings(text_dim: int) -> dict[str, torch.Tensor]:
    """Prompt and negative prompt embeddings of WanPipeline's full text length, the same for every side."""
    generator = torch.Generator().manual_seed(SEED)
    return {
        "prompt_embeds": torch.randn(1, TEXT_LENGTH, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, TEXT_LENGTH, text_dim, generator=generator),
    }


def after_each_step(stamp: Callable[[], None]) -> Callable:
    """WanPipeline's callback_on_step_end that stamps the step and changes nothing."""

    def on_step_end(pipeline, step: int, timestep: torch.Tensor, callback_kwargs: dict) -> dict:
        stamp()
        return callback_kwargs

    return on_step_end


def set_attention_backend(transformers: list[torch.nn.Module]) -> None:
    for transformer in transformers:
        transformer.set_attention_backend(ATTENTION_BACKEND)


def ratio(ours: float, theirs: float) -> float:
    return round(ours / theirs, 4)


# ---------------------------------------------------------------------------------------------
# Sections


def our_denoiser_sections(model: Path, mode: Mode, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """step_time (ours) and step_caches, on one eager denoiser built as the DiT stage builds it."""
    family = read_checkpoint(model).traits
    denoiser = make_denoiser(model, device, dtype)
    set_attention_backend(denoiser.experts)
    conditioning = random_embeddings(denoiser.text_dim)

    def request(spec: DenoiseSpec, mag_ratios: dict | None = None) -> Callable[[Callable[[], None]], object]:
        def run(stamp: Callable[[], None]) -> object:
            return denoise_request(
                denoiser, spec, conditioning, lambda step, total: stamp(), lambda: False, mag_ratios=mag_ratios
            )

        return run

    log(f"step_time: our denoiser, a one-step warm-up, then {mode.timing_steps} steps")
    request(spec_of(mode, 1))(lambda: None)
    step_time, _ = timed_run(device, request(spec_of(mode, mode.timing_steps)))
    step_time["denoiser"] = f"{type(denoiser).__module__}.{type(denoiser).__qualname__}"

    log(f"step_caches: uncached, {mode.steps} steps")
    uncached, (_, passes) = timed_run(device, request(spec_of(mode, mode.steps)))
    uncached.update(passes_run=passes.run, passes_skipped=passes.skipped)
    methods: dict[str, dict] = {}
    for method, feature in CACHE_FEATURES.items():  # every method a request may name but "none"
        support = family.support(feature)
        if not support.supported:
            methods[method] = {"offered": False, "reason": support.reason}
            continue
        mag_ratios = None
        calibration_s = None
        if method == "mag":
            log("step_caches: calibrating MagCache")
            started = time.perf_counter()
            mag_ratios = calibrate(denoiser, spec_of(mode, mode.steps), conditioning)
            calibration_s = round(time.perf_counter() - started, 3)
        threshold = DEFAULT_CACHE_THRESHOLDS[method]
        log(f"step_caches: {method} at {threshold}")
        cached, (_, passes) = timed_run(
            device, request(spec_of(mode, mode.steps, cache=CacheSpec(method, threshold)), mag_ratios)
        )
        methods[method] = {
            "offered": True,
            "threshold": threshold,
            **cached,
            "passes_run": passes.run,
            "passes_skipped": passes.skipped,
            "speedup_vs_uncached": ratio(uncached["request_s"], cached["request_s"]),
        }
        if calibration_s is not None:
            methods[method]["calibration_s"] = calibration_s
    step_caches = {"steps": mode.steps, "uncached": uncached, "methods": methods}
    return step_time, step_caches


def compile_section(model: Path, mode: Mode, device: torch.device, dtype: torch.dtype) -> dict:
    """The denoiser as `serve dit --compile` builds it: the first request compiles, the next is timed."""
    denoiser = make_denoiser(model, device, dtype, DenoiserBuild(options=ModelOptions(compile=True)))
    set_attention_backend(denoiser.experts)
    conditioning = random_embeddings(denoiser.text_dim)
    spec = spec_of(mode, mode.timing_steps)

    def run(stamp: Callable[[], None]) -> object:
        return denoise_request(denoiser, spec, conditioning, lambda step, total: stamp(), lambda: False)

    log("compile: first request (compiles the blocks)")
    first, _ = timed_run(device, run)
    log("compile: second request")
    compiled, _ = timed_run(device, run)
    blocks = sum(len(repeated_blocks(expert)) for expert in denoiser.experts)
    torch._dynamo.reset()  # the compiled graphs hold the blocks: let them go with the denoiser
    return {
        "backend": "inductor (Triton on CUDA)" if device.type == "cuda" else "inductor (C++ on CPU)",
        "blocks": blocks,
        "first_request_s": first["request_s"],
        **compiled,
    }


def diffusers_sections(
    model: Path, mode: Mode, device: torch.device, dtype: torch.dtype
) -> tuple[dict, dict, np.ndarray]:
    """step_time (WanPipeline's transformer) and end_to_end (WanPipeline) in this process; the frames."""
    with MemorySampler(device, lambda: [os.getpid()]) as sampler:
        log("diffusers: loading WanPipeline")
        started = time.perf_counter()
        pipeline = WanPipeline.from_pretrained(model, dtype=dtype).to(device)
        load_s = time.perf_counter() - started
        pipeline.set_progress_bar_config(disable=True)
        set_attention_backend([pipeline.transformer])
        embeddings = random_embeddings(pipeline.transformer.config.text_dim)
        embeddings = {name: tensor.to(device, dtype) for name, tensor in embeddings.items()}

        def transformer_steps(steps: int) -> Callable[[Callable[[], None]], object]:
            def run(stamp: Callable[[], None]) -> object:
                return pipeline(
                    prompt_embeds=embeddings["prompt_embeds"],
                    negative_prompt_embeds=embeddings["negative_prompt_embeds"],
                    height=mode.height,
                    width=mode.width,
                    num_frames=mode.num_frames,
                    num_inference_steps=steps,
                    guidance_scale=GUIDANCE_SCALE,
                    generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="latent",
                    callback_on_step_end=after_each_step(stamp),
                )

            return run

        log(f"step_time: WanPipeline's transformer, a one-step warm-up, then {mode.timing_steps} steps")
        transformer_steps(1)(lambda: None)
        step_time, _ = timed_run(device, transformer_steps(mode.timing_steps))

        def whole_request(prompt: str, negative_prompt: str, steps: int) -> Callable[[Callable[[], None]], object]:
            def run(stamp: Callable[[], None]) -> object:
                return pipeline(
                    prompt=prompt,
                    negative_prompt=negative_prompt,
                    height=mode.height,
                    width=mode.width,
                    num_frames=mode.num_frames,
                    num_inference_steps=steps,
                    guidance_scale=GUIDANCE_SCALE,
                    generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="np",
                    callback_on_step_end=after_each_step(stamp),
                ).frames[0]

            return run

        log("end_to_end: WanPipeline warm-up (1 step)")
        whole_request(WARM_UP_PROMPT, WARM_UP_NEGATIVE_PROMPT, 1)(lambda: None)
        log(f"end_to_end: WanPipeline, {mode.steps} steps")
        end_to_end, frames = timed_run(device, whole_request(PROMPT, NEGATIVE_PROMPT, mode.steps))
    end_to_end = {
        "load_s": round(load_s, 3),
        "request_s": end_to_end["request_s"],
        "denoise_step_s": end_to_end["step_s"],
        "peak_memory": end_to_end["peak_memory"],
        "sampled_memory": sampler.report(),
        "components_dtype": str(dtype).removeprefix("torch."),
    }
    return step_time, end_to_end, (np.asarray(frames) * 255).round().astype(np.uint8)


def cluster_section(model: Path, mode: Mode, device: torch.device, work: Path) -> tuple[dict, np.ndarray]:
    """One request through the local cluster of the single-GPU compose file, after a one-step warm-up."""
    size = dict(
        height=mode.height,
        width=mode.width,
        num_frames=mode.num_frames,
        guidance_scale=GUIDANCE_SCALE,
        seed=SEED,
    )
    cluster_env = {"DIFFUSERS_ATTN_BACKEND": ATTENTION_BACKEND}
    if device.type == "cpu":  # --dry-run: the stages see no GPU either, so that their `--device auto` is the CPU
        cluster_env["CUDA_VISIBLE_DEVICES"] = ""
    cluster = LocalCluster(
        model,
        compose_file=COMPOSE_FILE,
        log_dir=work / "cluster-logs",
        threads_per_stage=CPU_THREADS if device.type == "cpu" else None,
        env=cluster_env,
    )

    def cluster_pids() -> list[int]:
        return [service.pid for service in cluster.services.values()]

    with MemorySampler(device, cluster_pids) as sampler:
        log(f"end_to_end: starting the cluster ({COMPOSE_FILE.name})")
        started = time.perf_counter()
        cluster.start(timeout=1200)
        startup_s = time.perf_counter() - started
        try:
            with Client(cluster.endpoint) as client:
                info = client.cluster_info()
                stage_devices = {stage.info.stage: stage.info.device for stage in info.stages}
                if device.type == "cuda" and not all(value.startswith("cuda") for value in stage_devices.values()):
                    raise RuntimeError(f"the cluster's stages did not start on the GPU: {stage_devices}")
                log("end_to_end: cluster warm-up (1 step)")
                client.generate(
                    WARM_UP_PROMPT, negative_prompt=WARM_UP_NEGATIVE_PROMPT, num_inference_steps=1, timeout=1800, **size
                )
                log(f"end_to_end: cluster, {mode.steps} steps")
                started = time.perf_counter()
                result = client.generate(
                    PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=mode.steps, timeout=1800, **size
                )
                request_s = time.perf_counter() - started
        finally:
            cluster.stop()
    report = {
        "compose_file": str(COMPOSE_FILE.relative_to(PACKAGE_ROOT)),
        "services": sorted(cluster.compose),
        "stage_devices": stage_devices,
        "startup_s": round(startup_s, 3),
        "request_s": round(request_s, 4),
        "stage_s": {stage: round(seconds, 4) for stage, seconds in result.timings.items()},
        "sampled_memory": sampler.report(),
    }
    return report, result.frames


# ---------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"wan_gpu: {message}", file=sys.stderr, flush=True)


def environment(device: torch.device) -> dict:
    report = {
        "device_type": device.type,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
        "intra_op_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        report.update(
            device=torch.cuda.get_device_name(device),
            device_memory_bytes=properties.total_memory,
            compute_capability=f"{properties.major}.{properties.minor}",
            cuda=torch.version.cuda,
            sdpa_kernels_enabled={
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                "math": torch.backends.cuda.math_sdp_enabled(),
            },
        )
    else:
        report.update(device="cpu")
    return report


def anchors(mode_name: str, mode: Mode, cluster_s: float, diffusers_s: float) -> list[dict]:
    """Each anchor with our seconds over its seconds where our run is its request: the full run only (an anchor
    that does not state its frames or steps is taken at the reference request), and every size it states."""
    rows = []
    for anchor in ANCHORS:
        stated = {key: anchor[key] for key in ("height", "width", "num_frames", "steps") if key in anchor}
        same_request = mode_name == "full" and all(getattr(mode, key) == value for key, value in stated.items())
        rows.append(
            {
                **anchor,
                "same_request": same_request,
                "ours_cluster_over_anchor": ratio(cluster_s, anchor["seconds"]) if same_request else None,
                "diffusers_over_anchor": ratio(diffusers_s, anchor["seconds"]) if same_request else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="10 steps instead of 50 (step_time is the same run)")
    size.add_argument("--dry-run", action="store_true", help="the same sections on the CPU: tiny preset, 2 steps")
    parser.add_argument("--model", help=f"an existing {REAL_PRESET} checkpoint (default: write one)")
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args()
    mode_name = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    mode = MODES[mode_name]
    if mode.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            f"bench/wan_gpu.py needs a CUDA GPU and torch sees none (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); `--dry-run` runs the same sections on the CPU"
        )
    device, dtype = torch.device(mode.device), DTYPES[mode.dtype]
    if device.type == "cpu":
        torch.set_num_threads(CPU_THREADS)
    started = time.perf_counter()
    wall: dict[str, float] = {}

    def section(name: str, function: Callable, *arguments) -> object:
        """Runs one section, records its wall time and gives back the memory it left cached."""
        section_started = time.perf_counter()
        result = function(*arguments)
        wall[name] = round(time.perf_counter() - section_started, 2)
        free_memory(device)
        return result

    # stdout is the report alone: whatever the libraries print meanwhile goes to stderr.
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory(prefix="stagediff-wan-gpu-") as tmp:
        work = Path(tmp)
        if args.model:
            model = Path(args.model)
        else:
            log(f"writing the {mode.preset} checkpoint")
            model = section("checkpoint_write", init_model, "wan-t2v", mode.preset, work / mode.preset)
        checkpoint = {
            "family": read_checkpoint(model).traits.name,
            "preset": None if args.model else mode.preset,
            "path": str(model) if args.model else None,
            "write_s": wall.get("checkpoint_write"),
            "bytes": sum(path.stat().st_size for path in model.rglob("*") if path.is_file()),
            "transformer_config": json.loads((model / "transformer" / "config.json").read_text()),
        }
        vae_config = json.loads((model / "vae" / "config.json").read_text())
        with torch.no_grad():
            ours_step, step_caches = section(
                "ours_step_time_and_caches", our_denoiser_sections, model, mode, device, dtype
            )
            compiled = section("compile", compile_section, model, mode, device, dtype)
            diffusers_step, diffusers_e2e, diffusers_frames = section(
                "diffusers", diffusers_sections, model, mode, device, dtype
            )
        cluster_e2e, cluster_frames = section("cluster", cluster_section, model, mode, device, work)

    patch = checkpoint["transformer_config"]["patch_size"]
    spatial = vae_config.get("scale_factor_spatial", 8)
    latent_frames = (mode.num_frames - 1) // vae_config.get("scale_factor_temporal", 4) + 1
    video_tokens = latent_frames * (mode.height // spatial // patch[1]) * (mode.width // spatial // patch[2])
    frame_difference = np.abs(cluster_frames.astype(np.int16) - diffusers_frames.astype(np.int16))
    compiled["step_speedup_vs_eager"] = ratio(ours_step["step_s"], compiled["step_s"])
    report = {
        "benchmark": "wan_gpu",
        "mode": mode_name,
        "environment": environment(device),
        "dtype": mode.dtype,
        "attention_backend": {
            "diffusers_backend": ATTENTION_BACKEND,
            "kernel": "torch.nn.functional.scaled_dot_product_attention (torch picks flash, memory-efficient, "
            "cuDNN or math)",
            "set_with": "transformer.set_attention_backend in this process; DIFFUSERS_ATTN_BACKEND for the cluster",
        },
        "checkpoint": checkpoint,
        "config": {
            **asdict(mode),
            "guidance_scale": GUIDANCE_SCALE,
            "seed": SEED,
            "prompt": PROMPT,
            "negative_prompt": NEGATIVE_PROMPT,
            "text_tokens": TEXT_LENGTH,
            "video_tokens": video_tokens,
        },
        "step_time": {
            "steps_per_run": mode.timing_steps,
            "transformer_passes_per_step": 2,
            "ours": ours_step,
            "diffusers": diffusers_step,
            "ratio_ours_over_diffusers": ratio(ours_step["step_s"], diffusers_step["step_s"]),
        },
        "step_caches": step_caches,
        "compile": compiled,
        "end_to_end": {
            "steps": mode.steps,
            "ours_cluster": cluster_e2e,
            "diffusers": diffusers_e2e,
            "ratio_ours_over_diffusers": ratio(cluster_e2e["request_s"], diffusers_e2e["request_s"]),
            "frames_shape": list(cluster_frames.shape),
            "frames_mean_abs_difference_levels": round(float(frame_difference.mean()), 4),
            "frames_max_abs_difference_levels": int(frame_difference.max()),
        },
        "anchors": anchors(mode_name, mode, cluster_e2e["request_s"], diffusers_e2e["request_s"]),
        "section_wall_s": wall,
        "total_wall_s": round(time.perf_counter() - started, 2),
    }
    if mode_name == "dry-run":
        report["note"] = (
            "dry run: CPU, tiny preset, float32, one intra-op thread per process; every section ran its CPU path, "
            "the cluster on the single-GPU compose file with its stages on the CPU (device auto); memory is "
            "resident memory, not GPU memory; the times say nothing about a GPU"
        )
    else:
        report["note"] = (
            f"one CUDA GPU, bf16, {mode.preset}: Wan2.1-T2V-1.3B's configs with random weights; the cluster's "
            "stages on the same GPU"
        )
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
