"""What bench/image_families.py and bench/video_families.py share: a function run in a fresh process, the process's
peak resident memory, and a real-size preset (`*-config`: a published checkpoint's configs with random bf16 weights)
stage by stage against the memory guard.

Rules: every measurement that loads weights runs in a fresh process (spawned, so nothing of the parent is inherited
and each peak is the stage's own); the memory guard's need is computed by the functions the stages run
(services/memory_budget.py), once from the components built on the meta device (nothing is written) and once from
a written checkpoint's files; a written checkpoint is removed as soon as its stages are loaded. A stage whose
estimate the guard refuses on this machine is not loaded (nor, from `measure_written` given the estimate, written).
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# The stages that load weights; each component belongs to one (stage_of).
STAGES = ("text-encoder", "dit", "vae")


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a spawned process of its own; its result (picklable) back."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def stage_of(component: str) -> str:
    """The stage that loads `component`: the transformer the DiT, the VAE (with LTX-2's audio VAE and vocoder) the
    VAE stage, every encoder the text encoder's (SigLIP and CLIP vision, LTX-2's connectors included)."""
    return {"transformer": "dit", "vae": "vae", "audio_vae": "vae", "vocoder": "vae"}.get(component, "text-encoder")


def stage_components(stage: str, family: str, root: Path) -> dict[str, tuple[type, Path]]:
    """The checkpoint's components that `stage` loads, as its memory guard takes them (services/memory_budget.py):
    the text encoder's transformers models and its encoder's other components (LTX-2's connectors), the
    transformer, the decoder's components (the VAE; LTX-2's audio VAE and vocoder too)."""
    from families.registry import FAMILIES
    from services.memory_budget import checkpoint_components, text_encoder_components

    if stage == "text-encoder":
        others = getattr(FAMILIES[family].load("text_encoder"), "other_components", ())
        return text_encoder_components(root, others)
    if stage == "dit":
        return checkpoint_components(root, names=["transformer"])
    return checkpoint_components(root, names=FAMILIES[family].load("decoder").components)


def bf16_bytes(module: Any) -> int:
    """What load_pretrained holds of `module` in bf16: two bytes a weight, four for the modules the class keeps
    in fp32 (diffusers' `_keep_in_fp32_modules`; transformers' `_keep_in_fp32_modules_strict` in bf16)."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    if hasattr(module, "config") and hasattr(module, "_keep_in_fp32_modules_strict"):
        keep = set(module._keep_in_fp32_modules_strict or ())
    # A tensor saved under two names (a tied embedding and head) is held once.
    tensors = {id(tensor): (key, tensor) for key, tensor in module.state_dict(keep_vars=True).items()}
    return sum(
        tensor.numel() * (4 if keep.intersection(key.split(".")) else 2)
        for key, tensor in tensors.values()
        if tensor.is_floating_point()
    )


def estimate(builders: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """The guard's need per stage of a real-size preset from its components (`builders`: name -> a function
    building it) on the meta device, and its verdict against this machine's available memory."""
    import torch

    from services.memory_budget import MemoryBudgetError, WeightNeed, available_bytes, check_weights_fit

    components: dict[str, dict[str, int]] = {stage: {} for stage in STAGES}
    parameters: dict[str, int] = {}
    for name, build in builders.items():
        with torch.device("meta"):
            built = build()
        components[stage_of(name)][name] = bf16_bytes(built)
        parameters[name] = sum(p.numel() for p in built.parameters())
        del built
    available = available_bytes(torch.device("cpu"))
    stages = {}
    for stage, sizes in components.items():
        need = WeightNeed(stage, torch.device("cpu"), torch.bfloat16, sizes)
        try:
            check_weights_fit(need, available)
            refusal = None
        except MemoryBudgetError as error:
            refusal = f"stagediff serve {stage}: {error}"
        stages[stage] = {
            "components": sizes,
            "need_bytes": need.total_bytes,
            "fits": refusal is None,
            "refusal": refusal,
        }
    return {"parameters": parameters, "available_bytes": available[0], "stages": stages}


def load_stage(stage: str, family: str, model: str, threads: int) -> dict[str, Any]:
    """The stage's need from the checkpoint's files (as the stage computes it), then, where the guard lets it,
    its components loaded as it loads them (bf16, `threads` reader threads): seconds, peak resident memory,
    parameters; or the guard's refusal."""
    import torch

    from services.memory_budget import MemoryBudgetError, check_weights_fit, stage_need
    from stagekit.weights import load_pretrained

    components = stage_components(stage, family, Path(model))
    need = stage_need(stage, torch.device("cpu"), torch.bfloat16, components)
    try:
        check_weights_fit(need)
    except MemoryBudgetError as error:
        return {"guard_need_bytes": need.total_bytes, "refusal": f"stagediff serve {stage}: {error}"}
    started = time.perf_counter()
    loaded = [
        load_pretrained(cls, folder, dtype=torch.bfloat16, num_threads=threads) for cls, folder in components.values()
    ]
    seconds = time.perf_counter() - started
    return {
        "guard_need_bytes": need.total_bytes,
        "load_s": round(seconds, 2),
        "peak_rss_bytes": peak_rss(),
        "loaded_parameters": sum(p.numel() for module in loaded for p in module.parameters()),
    }


def need_from_files(stage: str, family: str, model: str) -> int:
    """The stage's need in bf16 on the CPU from the checkpoint's files, as the stage computes it before loading."""
    import torch

    from services.memory_budget import stage_need

    components = stage_components(stage, family, Path(model))
    return stage_need(stage, torch.device("cpu"), torch.bfloat16, components).total_bytes


def _write(family: str, preset: str, out: str, components: list[str] | None) -> dict[str, Any]:
    """init_model's preset; only `components` of it (and the files without weights) when given, through the
    family's writer (LTX-2's takes them)."""
    from families.init_model import init_model
    from families.registry import FAMILIES

    started = time.perf_counter()
    if components is None:
        init_model(family, preset, out)
    else:
        Path(out).mkdir(parents=True, exist_ok=True)
        FAMILIES[family].load("writer")(FAMILIES[family], Path(out), preset, 0, {}, components=components)
    return {"write_s": round(time.perf_counter() - started, 1), "write_peak_rss_bytes": peak_rss()}


def write_refused_stage(family: str, preset: str, stage: str, components: list[str], root: Path) -> dict[str, Any]:
    """A stage the guard refuses here, written alone (a writer that takes `components`): the write's seconds and
    peak, its size, and the need from its files; nothing is loaded, and it is removed after."""
    out = root / f"{preset}-{stage}"
    try:
        written = in_fresh_process(_write, family, preset, str(out), components)
        disk = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
        need = in_fresh_process(need_from_files, stage, family, str(out))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {**written, "disk_bytes": disk, "guard_need_bytes": need}


def measure_written(
    family: str,
    preset: str,
    threads: int,
    root: Path,
    estimated: dict[str, dict[str, Any]] | None = None,
    write_refused: bool = False,
) -> dict[str, Any]:
    """Writes the preset under `root` (in a fresh process: the writer's peak is its own and nothing of it stays
    in this one), loads each stage's components from it in a fresh process, then removes it.

    `estimated`: the guard's verdict per stage from the meta device (`estimate(...)["stages"]`). The components of
    a stage it refuses on this machine are neither written nor loaded (a real-size LTX-2 text encoder or DiT would
    fill the disk and could not load); the other stages' components are then written alone, by the family's writer
    (one that takes `components`, as LTX-2's). `write_refused`: each refused stage is then written alone too
    (`write_refused_stage`), for its write and its need from the files.
    """
    estimated = estimated or {}
    refused = [stage for stage in STAGES if stage in estimated and not estimated[stage]["fits"]]
    stages = [stage for stage in STAGES if stage not in refused]
    components = None
    if refused:
        components = [name for stage in stages for name in estimated[stage]["components"]]
    out = root / preset
    try:
        written = in_fresh_process(_write, family, preset, str(out), components)
        disk = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
        loads = {stage: in_fresh_process(load_stage, stage, family, str(out), threads) for stage in stages}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    skipped: dict[str, dict[str, Any]] = {stage: {"not_loaded": estimated[stage]["refusal"]} for stage in refused}
    for stage in refused if write_refused else ():
        components_of = list(estimated[stage]["components"])
        skipped[stage]["written_alone"] = write_refused_stage(family, preset, stage, components_of, root)
    return {**written, "disk_bytes": disk, "components_written": components, "stages": {**loads, **skipped}}
