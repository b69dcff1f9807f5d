"""Whether a stage's weights fit where it will hold them, checked before it loads them.

A stage that loads more than its device holds is killed by the OOM killer (CPU) without a word about which stage
or why, or fails deep inside the load (CUDA). So each stage, before it loads, computes the bytes its weights will
take in the target dtype on the target device (`stagekit.weights.planned_bytes`, from the safetensors headers, by
the rule `load_pretrained` casts by) and, when they do not fit, refuses to start with one message naming the
stage, the bytes needed and available, and the flags that would make it fit (raised by services/stage_main.py as
the stage's startup error).

Needed: the weights of every component the stage loads, times the processes on this machine that each hold a copy
(CPU ranks of a DiT or patch-parallel VAE group), plus RUNTIME_RESERVE_BYTES for the process and a small
request's activations. Weights left as views of the mapped files count too: they become resident as they load.

Available: on CPU psutil's available memory, lowered to what a cgroup v2 limit still allows (memory.max less
memory.current, for the process's cgroup and each one above it); on CUDA torch.cuda.mem_get_info's free bytes.
STAGEDIFF_MEMORY_AVAILABLE_BYTES (an integer) replaces that figure, to keep memory back for other processes or to
exercise the guard at a small scale.
The check is per process: stages starting at once on one machine each see what the others have not taken yet.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Replaces the measured available memory (bytes) when set.
AVAILABLE_ENV = "STAGEDIFF_MEMORY_AVAILABLE_BYTES"
# Added to the weights: what the interpreter, torch and gRPC keep resident on the CPU, and the activations
# of a small request.
RUNTIME_RESERVE_BYTES = 1 << 30
CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryBudgetError(RuntimeError):
    """The stage's weights do not fit in the memory available; the message says what would."""


@dataclass(frozen=True)
class WeightNeed:
    """What one stage will hold: bytes per component (all copies on this machine), where and in what dtype.

    `fixes` are the stage's own flags that would make the weights fit, each with what it changes, in the
    order to try them.
    """

    stage: str
    device: torch.device
    dtype: torch.dtype
    components: dict[str, int]
    copies: int = 1
    fixes: Sequence[str] = field(default_factory=tuple)

    @property
    def weight_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + RUNTIME_RESERVE_BYTES * self.copies


def format_bytes(nbytes: int) -> str:
    """Decimal gigabytes (as disk and checkpoint sizes are given), or megabytes below one GB."""
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.1f} GB"
    return f"{nbytes / 1e6:.0f} MB"


def dtype_flag(dtype: torch.dtype) -> str:
    """The --dtype value that names `dtype`."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def component_bytes(model_class: type[torch.nn.Module], directory: Path, dtype: torch.dtype) -> int:
    """The bytes `load_pretrained` will hold for one component folder in `dtype`."""
    from stagekit.weights import planned_bytes

    return planned_bytes(model_class, directory, dtype=dtype)


def cgroup_headroom(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The bytes the cgroup v2 limits of this process still allow (the least over its cgroup and those above
    it), or None when no limit is set or there is no cgroup v2 hierarchy."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    unified = [line.split("::", 1)[1] for line in lines if line.startswith("0::")]
    if not unified:
        return None
    headroom: int | None = None
    path = cgroup_root / unified[0].strip().lstrip("/")
    while True:
        try:
            limit = (path / "memory.max").read_text().strip()
            current = int((path / "memory.current").read_text().strip())
        except (OSError, ValueError):
            limit, current = "max", 0
        if limit != "max":
            room = max(0, int(limit) - current)
            headroom = room if headroom is None else min(headroom, room)
        if path == cgroup_root or cgroup_root not in path.parents:
            return headroom
        path = path.parent


def available_bytes(device: torch.device) -> tuple[int, str]:
    """The memory a stage may still take on `device`, and where the figure comes from."""
    override = os.environ.get(AVAILABLE_ENV)
    if override is not None:
        try:
            return int(override), f"${AVAILABLE_ENV}"
        except ValueError:
            raise MemoryBudgetError(f"${AVAILABLE_ENV}={override!r}: give a number of bytes") from None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    import psutil

    available = psutil.virtual_memory().available
    headroom = cgroup_headroom()
    if headroom is not None and headroom < available:
        return headroom, "left under the cgroup's memory.max"
    return available, "available memory of this machine"


def check_weights_fit(need: WeightNeed, available: tuple[int, str] | None = None) -> None:
    """Raises MemoryBudgetError when `need` does not fit in `available` (default: measured on its device)."""
    free, source = available if available is not None else available_bytes(need.device)
    if need.total_bytes <= free:
        return
    parts = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in need.components.items())
    copies = f" for {need.copies} processes on this machine" if need.copies > 1 else ""
    fixes = "; ".join(need.fixes) if need.fixes else "none of this stage's flags makes them fit: use a larger machine"
    raise MemoryBudgetError(
        f"not enough memory to load the {need.stage} stage's weights: they need {format_bytes(need.total_bytes)} "
        f"on {need.device} as {dtype_flag(need.dtype)}{copies} ({parts}, plus "
        f"{format_bytes(RUNTIME_RESERVE_BYTES * need.copies)} to run), but {format_bytes(free)} is available "
        f"({source}). To fit: {fixes}"
    )


def checkpoint_components(root: Path, names: Sequence[str] = (), library: str = "") -> dict[str, tuple[type, Path]]:
    """The components of the checkpoint at `root` that have safetensors weights: name -> (class, folder).

    Taken from model_index.json: those named in `names`, or every one of `library` ("transformers",
    "diffusers") when `names` is empty. Components without weights (tokenizers, processors, schedulers) and
    folders without safetensors files are left out.
    """
    import json

    index = json.loads((root / "model_index.json").read_text())
    found: dict[str, tuple[type, Path]] = {}
    for name, entry in index.items():
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] is None or entry[1] is None:
            continue
        if (names and name not in names) or (not names and entry[0] != library):
            continue
        folder = root / name
        if not any(folder.glob("*.safetensors")):
            continue
        found[name] = (getattr(_library_module(entry[0]), entry[1]), folder)
    return found


def text_encoder_components(root: Path, others: Sequence[str] = ()) -> dict[str, tuple[type, Path]]:
    """The text encoder stage's components of the checkpoint at `root`: every transformers model (the text encoders,
    and the image encoder of families that have one) and `others`, the components of other libraries its encoder
    loads too (`PromptEncoder.other_components`: LTX-2's connectors)."""
    components = checkpoint_components(root, library="transformers")
    if others:
        components.update(checkpoint_components(root, names=others))
    return components


def _library_module(library: str) -> object:
    """The module a model_index.json library names, as diffusers resolves it: an installed package ("diffusers",
    "transformers"), or one of diffusers' pipeline folders ("ltx2": the LTX-2 vocoder and connectors)."""
    import importlib

    try:
        return importlib.import_module(library)
    except ModuleNotFoundError:
        return importlib.import_module(f"diffusers.pipelines.{library}")


def stage_need(
    stage: str,
    device: torch.device,
    dtype: torch.dtype,
    components: dict[str, tuple[type, Path]],
    *,
    copies: int = 1,
    split: int = 1,
    held_as_stored: dict[str, int] | None = None,
    fixes: Sequence[str] = (),
) -> WeightNeed:
    """The need of a stage that loads `components` in `dtype` on `device`.

    `copies`: processes on this machine that each hold the weights; `split`: parts each process's copy is
    split into (tensor parallelism, HSDP shards), so that one process holds 1/split. `held_as_stored`:
    components held at their file size whatever the dtype (GGUF weights), name -> bytes. When the dtype is
    float32, the first fix offered is --dtype bfloat16 with what it would need.
    """

    def weights(load_dtype: torch.dtype) -> dict[str, int]:
        sizes = {name: component_bytes(cls, folder, load_dtype) for name, (cls, folder) in components.items()}
        sizes.update(held_as_stored or {})
        return {name: nbytes * copies // split for name, nbytes in sizes.items()}

    offered = []
    if dtype == torch.float32 and components:
        in_bf16 = WeightNeed(stage, device, torch.bfloat16, weights(torch.bfloat16), copies)
        offered.append(f"--dtype bfloat16 ({format_bytes(in_bf16.total_bytes)} in all)")
    return WeightNeed(stage, device, dtype, weights(dtype), copies, (*offered, *fixes))
