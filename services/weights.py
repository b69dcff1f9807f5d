"""Loading a model's safetensors weights straight into their final dtype and device, with several threads.

`from_pretrained` in diffusers and transformers builds the model and then streams each shard through
mmap-backed tensors, casting and placing one parameter at a time, one shard at a time unless told
otherwise; weights it does not cast stay views of the mapped files, read from disk only when first
used. A stage that restarts often spends most of its start-up there. `load_pretrained` does the
same job with less in between:

1. The model is built from its config with `accelerate.init_empty_weights(include_buffers=False)`:
   parameters are created on the meta device (no allocation, no random init), while buffers are
   created for real by the module's own `__init__`. Buffers that are not saved weights (Wan's RoPE
   tables, anything registered with `persistent=False`) therefore hold exactly the values
   `from_pretrained` computes, with no per-class code to recompute them. The default dtype is set to
   the requested one while building, as both libraries do, so such buffers also get the same dtype.
2. The safetensors headers (a single file or the shards listed by `*.safetensors.index.json`) are read
   first: every key the model expects must be there, none may be extra, shapes must match, before any
   tensor is read. A mismatch raises ValueError naming the keys.
3. Each file is mapped once (private, copy-on-write). While the model is being built, a pool of
   `num_threads` threads already faults every page of the files into the mappings (reading them from
   disk if they are not cached). Then a tensor that needs no cast on the CPU stays a view of the
   mapping, the page cache's own pages, with no copy, as safetensors and both libraries'
   from_pretrained leave it, but resident when the call returns rather than read on the first forward
   pass; any other tensor is cast to its final dtype (modules the class keeps in fp32 stay fp32) or
   moved to its final device once, straight from the mapping, by the pool. All tensors are then
   assigned with `load_state_dict(assign=True)`, and tied weights are re-tied. Writing to a loaded
   weight copies that page; the file is never changed.

A rank that will hold only part of a model reads only that part. `shard_model` (tensor parallelism,
FSDP2/HSDP) is applied to the empty model; every parameter it turns into a DTensor is then read as
this rank's slice only, straight from the file into the local shard (see `load_pretrained`).
`tensor_filter` instead skips whole tensors, e.g. the blocks another pipeline stage holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

logger = logging.getLogger(__name__)

# Attribute of a model returned by `load_pretrained` holding its `LoadStats`.
STATS_ATTR = "weight_load_stats"

# safetensors dtype names -> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class ShardStats:
    """What reading one safetensors file cost."""

    file: str
    bytes: int
    seconds: float


@dataclass
class LoadStats:
    """What one `load_pretrained` call read and how long it took (seconds: the whole call)."""

    total_bytes: int = 0
    seconds: float = 0.0
    threads: int = 1
    tensors: int = 0
    shards: list[ShardStats] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    file: Path
    name: str  # name in the file
    key: str  # name in the model (after any renaming the model class declares)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def load_stats(model: nn.Module) -> LoadStats:
    """The `LoadStats` of a model returned by `load_pretrained`."""
    return getattr(model, STATS_ATTR)


def load_pretrained(
    model_class: type[nn.Module],
    directory: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_threads: int = 4,
    keep_in_fp32: Sequence[str] | None = None,
    tensor_filter: Callable[[str], bool] | None = None,
    shard_model: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build `model_class` from the config in `directory` and load its safetensors weights into it.

    `model_class` is a diffusers `ModelMixin` or a transformers `PreTrainedModel` class; `directory`
    is a component folder (e.g. `<checkpoint>/transformer`). Floating-point weights are cast to
    `dtype`, except those the class keeps in fp32 (diffusers: `_keep_in_fp32_modules`, always;
    transformers: `_keep_in_fp32_modules` for fp16 and `_keep_in_fp32_modules_strict` for fp16 and
    bf16), exactly as `from_pretrained(torch_dtype=dtype)` does. `keep_in_fp32` overrides the class's
    list: module names matched against the components of each dotted key (`[]` keeps nothing in fp32).
    `num_threads` reads run at once (1: one after another, in file order).

    `tensor_filter(key) -> bool` selects the model keys to read; the rest are never read from disk and
    stay on the meta device, for the caller to fill (or to drop, e.g. by replacing the layers another
    rank holds). A rank of a pipeline split that owns blocks 0-19 would pass
    `lambda key: not key.startswith("blocks.") or int(key.split(".")[1]) < 20`. The key checks then
    apply only to the selected keys. Without a filter every key must be loaded.

    The returned model is in eval mode; `load_stats(model)` gives what was read and how fast.
    """
    start = time.perf_counter()
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    if shard_model is not None and tensor_filter is not None:
        raise ValueError("shard_model and tensor_filter cannot be combined")
    directory = Path(directory)
    device = torch.device(device)
    library = _library_of(model_class)
    entries = _read_headers(_weight_files(directory))
    stats = LoadStats(threads=num_threads)
    if shard_model is not None:
        model = _load_sharded(model_class, directory, library, entries, device, dtype, keep_in_fp32, shard_model, stats)
        return _finish_stats(model, model_class, directory, stats, start)

    with _Reader(entries, num_threads, stats) as reader:
        reading = None
        if library == "diffusers":
            # File names are the model's keys and the class alone decides each dtype (as in diffusers'
            # from_pretrained), so the tensors are read and cast while the model is being built.
            keep_fp32 = _fp32_matcher(model_class, library, dtype, keep_in_fp32)
            early = [entry for entry in entries if tensor_filter is None or tensor_filter(entry.key)]
            reading = reader.start(early, functools.partial(_target_dtype, dtype, keep_fp32, None), device)
        elif tensor_filter is None:
            reader.prefetch()  # transformers may rename keys: only fault the files in while building

        model = _build_empty(model_class, directory, library, dtype)
        entries = _rename(entries, model, library)
        meta_state = model.state_dict(keep_vars=True)
        tied = _tied_keys(model)
        wanted = {key for key in meta_state if tensor_filter is None or tensor_filter(key)}
        _check_keys(model_class, directory, meta_state, entries, wanted, tied, tensor_filter is not None)
        to_read = [entry for entry in entries if entry.key in wanted]
        if reading is None:
            keep_fp32 = _fp32_matcher(model, library, dtype, keep_in_fp32)
            reading = reader.start(to_read, functools.partial(_target_dtype, dtype, keep_fp32, meta_state), device)
        state = reader.collect(reading, to_read)

    with torch.no_grad():
        model.load_state_dict(state, strict=False, assign=True)
    del state
    _finish(model, library, device, directory, tied, wanted)
    stats.tensors = len(to_read)
    return _finish_stats(model, model_class, directory, stats, start)


def planned_bytes(
    model_class: type[nn.Module],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    keep_in_fp32: Sequence[str] | None = None,
) -> int:
    """The bytes of the weights `load_pretrained(model_class, directory, dtype=dtype)` will hold, read no tensor.

    The safetensors headers give each tensor's shape; its final dtype follows the same rule as the load
    (floating-point tensors cast to `dtype` unless the class keeps them in fp32, others as stored). The model
    is built empty (parameters on the meta device), as the load builds it, to rename keys and read the dtype
    plan. A tensor the model does not take is not counted (the load refuses it). services/memory_budget.py
    checks the result against the memory available before a stage loads.
    """
    directory = Path(directory)
    library = _library_of(model_class)
    entries = _read_headers(_weight_files(directory))
    model = _build_empty(model_class, directory, library, dtype)
    entries = _rename(entries, model, library)
    if library == "diffusers":
        keep_fp32 = _fp32_matcher(model_class, library, dtype, keep_in_fp32)
        meta_state = None
    else:
        keep_fp32 = _fp32_matcher(model, library, dtype, keep_in_fp32)
        meta_state = model.state_dict(keep_vars=True)
    expected = set(model.state_dict().keys())
    total = 0
    for entry in entries:
        if entry.key in expected:
            total += math.prod(entry.shape) * _target_dtype(dtype, keep_fp32, meta_state, entry).itemsize
    return total


def _finish_stats(
    model: nn.Module, model_class: type[nn.Module], directory: Path, stats: LoadStats, start: float
) -> nn.Module:
    stats.seconds = time.perf_counter() - start
    setattr(model, STATS_ATTR, stats)
    logger.info(
        "loaded %s from %s: %d tensors, %.3f GB in %.3f s (%.2f GB/s, %d threads)",
        model_class.__name__,
        directory,
        stats.tensors,
        stats.total_bytes / 1e9,
        stats.seconds,
        stats.gb_per_s,
        stats.threads,
    )
    return model


def _target_dtype(
    dtype: torch.dtype,
    keep_fp32: Callable[[str], bool],
    meta_state: dict[str, torch.Tensor] | None,
    entry: _TensorEntry,
) -> torch.dtype:
    """The dtype a checkpoint tensor ends in, by the rule of the model's library.

    Only floating-point tensors are cast. transformers (`meta_state` given) also keeps the dtype of a
    tensor the class creates in a dtype of its own; diffusers casts every other one to `dtype`.
    """
    if not entry.dtype.is_floating_point:
        return entry.dtype
    if keep_fp32(entry.key):
        return torch.float32
    if meta_state is not None and dtype != meta_state[entry.key].dtype:
        return meta_state[entry.key].dtype
    return dtype


# ---------------------------------------------------------------------------------------------
# Building the model without allocating its parameters.


def _library_of(model_class: type[nn.Module]) -> str:
    from diffusers import ModelMixin

    if issubclass(model_class, ModelMixin):
        return "diffusers"
    from transformers import PreTrainedModel

    if issubclass(model_class, PreTrainedModel):
        return "transformers"
    raise TypeError(f"{model_class.__name__} is neither a diffusers ModelMixin nor a transformers PreTrainedModel")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Both libraries build the model under the requested default dtype, which decides buffer dtypes."""
    previous = torch.get_default_dtype()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build_empty(model_class: type[nn.Module], directory: Path, library: str, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device and buffers computed for real by `__init__`."""
    from accelerate import init_empty_weights

    if library == "diffusers":
        from diffusers.models.modeling_utils import no_init_weights

        config = model_class.load_config(directory)
        with no_init_weights(), init_empty_weights(include_buffers=False), _default_dtype(dtype):
            return model_class.from_config(config)

    config = model_class.config_class.from_pretrained(directory)
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        model = model_class(config)
    return model


def _tied_keys(model: nn.Module) -> dict[str, str]:
    """Model key -> the key it is tied to, for weights saved once and shared (transformers' tied embeddings)."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.setdefault(name, first_name[id(param)])
        else:
            first_name[id(param)] = name
    return tied


def _fp32_matcher(
    model: nn.Module | type[nn.Module], library: str, dtype: torch.dtype, keep_in_fp32: Sequence[str] | None
) -> Callable[[str], bool]:
    """Which keys stay fp32, by the same rule as the library's from_pretrained unless overridden."""
    if keep_in_fp32 is not None:
        names = set(keep_in_fp32)
        return lambda key: bool(names.intersection(key.split(".")))
    if library == "diffusers":
        names = set(getattr(model, "_keep_in_fp32_modules", None) or [])
        return lambda key: bool(names.intersection(key.split(".")))

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return lambda key: False
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_to_glob, _ = build_glob_alternation(list(plan))

    def match(key: str) -> bool:
        found = pattern.search(key)
        return found is not None and plan[group_to_glob[found.lastgroup]] == torch.float32

    return match


# ---------------------------------------------------------------------------------------------
# Finding and checking the weights.


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of one component: the shards its index lists, or its single file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{directory} holds several safetensors indexes: {[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        return [directory / name for name in files]
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        found = [p.name for p in files] or "none"
        raise ValueError(f"{directory}: expected one *.safetensors file or a *.safetensors.index.json, found {found}")
    return files


def _key_renamer(model: nn.Module, library: str) -> Callable[[str], str]:
    """Maps checkpoint names to model names where the model class declares renamings (transformers 5)."""
    if library != "transformers":
        return lambda name: name
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)

    def rename(name: str) -> str:
        key, converter = rename_source_key(name, renamings, converters, prefix, meta_state)
        if key not in meta_state and name in meta_state:
            key, converter = name, None
        if converter is not None:
            raise NotImplementedError(
                f"{type(model).__name__}: checkpoint tensor {name!r} needs a conversion ({converter}), "
                "which only from_pretrained performs"
            )
        return key

    return rename


def read_safetensors(path: str | os.PathLike[str], num_threads: int = 4) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on the CPU as stored, read by the same thread pool as a checkpoint
    (for files that fill no model of their own, such as LoRA adapters). The tensors are views of the file's
    private mapping, resident when this returns."""
    entries = _read_headers([Path(path)])
    stats = LoadStats(threads=num_threads)
    with _Reader(entries, num_threads, stats) as reader:
        return reader.collect(reader.start(entries, lambda entry: entry.dtype, torch.device("cpu")), entries)


def _read_headers(files: list[Path]) -> list[_TensorEntry]:
    """Every tensor of every file, from the safetensors headers only (8-byte length, then JSON)."""
    entries: list[_TensorEntry] = []
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            entries.append(
                _TensorEntry(
                    file=path,
                    name=name,
                    key=name,
                    dtype=_DTYPES[info["dtype"]],
                    shape=tuple(info["shape"]),
                    offset=data_start + begin,
                    nbytes=end - begin,
                )
            )
    return entries


def _rename(entries: list[_TensorEntry], model: nn.Module, library: str) -> list[_TensorEntry]:
    rename = _key_renamer(model, library)
    return [dataclasses.replace(entry, key=rename(entry.name)) for entry in entries]


def _names(keys: Sequence[str] | set[str], limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_keys(
    model_class: type[nn.Module],
    directory: Path,
    meta_state: dict[str, torch.Tensor],
    entries: list[_TensorEntry],
    wanted: set[str],
    tied: dict[str, str],
    filtered: bool,
) -> None:
    """Every wanted key is in the files once with the right shape, and the files hold nothing else."""
    in_files: dict[str, _TensorEntry] = {}
    duplicates = set()
    for entry in entries:
        if entry.key in in_files:
            duplicates.add(entry.key)
        in_files[entry.key] = entry
    unexpected = set(in_files) - set(meta_state)
    missing = {key for key in wanted - set(in_files) if not (key in tied and tied[key] in in_files)}
    where = f"{model_class.__name__} from {directory}"
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_names(unexpected)}")
    if duplicates:
        problems.append(f"keys stored more than once ({len(duplicates)}): {_names(duplicates)}")
    mismatched = [
        f"{key} (file {list(entry.shape)}, model {list(meta_state[key].shape)})"
        for key, entry in in_files.items()
        if key in meta_state and tuple(meta_state[key].shape) != entry.shape
    ]
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {_names(mismatched)}")
    if problems:
        raise ValueError(f"cannot load {where}: " + "; ".join(problems))
    if filtered:
        logger.info("%s: reading %d of %d keys (tensor_filter)", where, len(wanted & set(in_files)), len(in_files))


# ---------------------------------------------------------------------------------------------
# Reading.


def _map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private (copy-on-write) mapping: nothing is read yet."""
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), False, size)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))


def _view(mapped: torch.Tensor, entry: _TensorEntry) -> torch.Tensor:
    """`entry` as a tensor over the mapping (a private copy if its offset is not aligned to its dtype)."""
    raw = mapped[entry.offset : entry.offset + entry.nbytes]
    if entry.offset % entry.dtype.itemsize:
        raw = raw.clone()
    return raw.view(entry.dtype).reshape(entry.shape)


def _plan_tasks(entries: list[_TensorEntry], num_threads: int) -> list[list[_TensorEntry]]:
    """Groups of tensors of one file each, balanced by bytes, enough of them to keep every thread busy.

    Files are cut into pieces of at most total / (2 * threads) bytes, and the pieces are ordered
    largest first so that the last piece to finish is a small one.
    """
    by_file: dict[Path, list[_TensorEntry]] = defaultdict(list)
    for entry in entries:
        by_file[entry.file].append(entry)
    if num_threads == 1:
        return [sorted(group, key=lambda e: e.offset) for group in by_file.values()]
    total = sum(e.nbytes for e in entries)
    piece = max(1, total // (2 * num_threads))
    tasks: list[list[_TensorEntry]] = []
    for group in by_file.values():
        current: list[_TensorEntry] = []
        size = 0
        for entry in sorted(group, key=lambda e: e.offset):
            current.append(entry)
            size += entry.nbytes
            if size >= piece:
                tasks.append(current)
                current, size = [], 0
        if current:
            tasks.append(current)
    tasks.sort(key=lambda task: -sum(e.nbytes for e in task))
    return tasks


class _Reader:
    """The thread pool that reads a checkpoint's files, mapped once each (private, copy-on-write).

    `prefetch` faults every page of every file into the mappings in the background: it needs no model,
    so it runs while the model is being built. `load` then turns entries into tensors: a tensor that
    needs no cast on the CPU stays a view of the mapping, the page cache's own pages (no copy, as
    safetensors and both libraries' from_pretrained leave it, but here resident when loading returns);
    any other is cast or moved once, straight from the mapping.
    """

    def __init__(self, entries: list[_TensorEntry], num_threads: int, stats: LoadStats) -> None:
        self.entries = entries
        self.num_threads = num_threads
        self.stats = stats
        self.mapped = {path: _map_file(path) for path in dict.fromkeys(entry.file for entry in entries)}
        self.pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="weights")
        self.prefetched: list[Future[None]] = []
        self.lock = threading.Lock()
        self.file_times: dict[Path, list[float]] = {}
        self.page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _timed(self, path: Path, t0: float) -> None:
        with self.lock:
            times = self.file_times.setdefault(path, [t0, t0])
            times[0], times[1] = min(times[0], t0), max(times[1], time.perf_counter())

    def _fault_in(self, path: Path, first: int, last: int) -> None:
        """Start the kernel reading bytes [first, last) of `path`, then map every page of them."""
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        if last > first:
            self.mapped[path][first : last : self.page].max()
        self._timed(path, t0)

    def prefetch(self) -> None:
        tasks = _plan_tasks(self.entries, self.num_threads)
        self.prefetched = [
            self.pool.submit(self._fault_in, task[0].file, task[0].offset, task[-1].offset + task[-1].nbytes)
            for task in tasks
        ]

    def start(
        self,
        entries: list[_TensorEntry],
        target_dtype: Callable[[_TensorEntry], torch.dtype],
        device: torch.device,
    ) -> list[Future[dict[str, torch.Tensor]]]:
        """Begin turning `entries` into tensors in their target dtype on `device`; `collect` gathers them."""
        resident = bool(self.prefetched)
        on_cpu = device.type == "cpu"

        def run(task: list[_TensorEntry]) -> dict[str, torch.Tensor]:
            t0 = time.perf_counter()
            loaded: dict[str, torch.Tensor] = {}
            for entry in task:
                mapped = self.mapped[entry.file]
                raw = _view(mapped, entry) if entry.nbytes else torch.empty(entry.shape, dtype=entry.dtype)
                want = target_dtype(entry)
                if on_cpu and want == entry.dtype:
                    if not resident:  # a view must be resident before loading returns
                        self._fault_in(entry.file, entry.offset, entry.offset + entry.nbytes)
                    loaded[entry.key] = raw
                elif on_cpu:
                    loaded[entry.key] = raw.to(want)
                else:
                    loaded[entry.key] = raw.to(device).to(want)  # the cast runs on the device
            self._timed(task[0].file, t0)
            return loaded

        return [self.pool.submit(run, task) for task in _plan_tasks(entries, self.num_threads)]

    def fill(
        self,
        entries: list[_TensorEntry],
        target_dtype: Callable[[_TensorEntry], torch.dtype],
        destinations: dict[str, tuple[torch.Tensor, tuple[slice, ...]]],
    ) -> None:
        """Copies the `region` of each entry into its allocated destination (cast on the destination's device)."""

        def run(task: list[_TensorEntry]) -> None:
            t0 = time.perf_counter()
            for entry in task:
                destination, region = destinations[entry.key]
                if destination.dtype != target_dtype(entry):
                    raise ValueError(f"{entry.key}: allocated as {destination.dtype}, loads as {target_dtype(entry)}")
                if entry.nbytes:
                    destination.copy_(_view(self.mapped[entry.file], entry)[region])
            self._timed(task[0].file, t0)

        futures = [self.pool.submit(run, task) for task in _plan_tasks(entries, self.num_threads)]
        for future in futures:
            future.result()
        self._account(entries, lambda entry: destinations[entry.key][0].numel() * entry.dtype.itemsize)

    def collect(
        self, futures: list[Future[dict[str, torch.Tensor]]], entries: list[_TensorEntry]
    ) -> dict[str, torch.Tensor]:
        """The tensors `start` made, keyed by model key; logs what each file cost."""
        state: dict[str, torch.Tensor] = {}
        for future in futures:
            state.update(future.result())
        for future in self.prefetched:
            future.result()
        self._account(entries, lambda entry: entry.nbytes)
        return state

    def _account(self, entries: list[_TensorEntry], nbytes_read: Callable[[_TensorEntry], int]) -> None:
        """Adds each file's bytes read and seconds to the stats and logs them."""
        per_file: dict[Path, int] = defaultdict(int)
        for entry in entries:
            per_file[entry.file] += nbytes_read(entry)
        for path, nbytes in per_file.items():
            t0, t1 = self.file_times.get(path, (0.0, 0.0))
            shard = ShardStats(file=path.name, bytes=nbytes, seconds=t1 - t0)
            self.stats.shards.append(shard)
            self.stats.total_bytes += nbytes
            logger.info("read %s: %d bytes in %.3f s", shard.file, shard.bytes, shard.seconds)


# ---------------------------------------------------------------------------------------------
# After the tensors are in.


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    path, _, name = key.rpartition(".")
    module = model.get_submodule(path)
    if name in module._parameters:
        module._parameters[name] = value if isinstance(value, nn.Parameter) else nn.Parameter(value)
    else:
        module._buffers[name] = value


def _finish(
    model: nn.Module, library: str, device: torch.device, directory: Path, tied: dict[str, str], wanted: set[str]
) -> None:
    """Re-tie shared weights, move the buffers `__init__` made onto `device`, and check nothing is left empty."""
    with torch.no_grad():
        if library == "transformers":
            model.tie_weights()
        for key, source in tied.items():
            value = model.get_parameter(source)
            if not value.is_meta:
                _set_tensor(model, key, value)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    left = [key for key, value in model.state_dict(keep_vars=True).items() if value.is_meta and key in wanted]
    if left:
        raise ValueError(f"cannot load {type(model).__name__} from {directory}: not filled: {_names(left)}")
    if library == "diffusers":
        model.register_to_config(_name_or_path=str(directory))
    model.eval()


# ---------------------------------------------------------------------------------------------
# Loading only this rank's shards.


def _local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank holds: everything for a plain tensor, its shard for a DTensor.

    Shards follow `torch.chunk` along each `Shard(dim)` placement, mesh dimension by mesh dimension (the
    layout of ColwiseParallel, RowwiseParallel and fully_shard); the result is checked against the local
    tensor's shape, so a layout this does not know (strided shards) fails loudly instead of loading the
    wrong rows.
    """
    if not isinstance(tensor, DTensor):
        return tuple(slice(None) for _ in tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    begins = [0] * tensor.ndim
    sizes = list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(f"cannot load a parameter placed as {placement} shard by shard")
        dim, parts, index = placement.dim, mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-sizes[dim] // parts)
        offset = min(index * chunk, sizes[dim])
        begins[dim] += offset
        sizes[dim] = max(0, min(chunk, sizes[dim] - offset))
    local_shape = tuple(tensor.to_local().shape)
    if tuple(sizes) != local_shape:
        raise NotImplementedError(
            f"shard layout {tensor.placements} gives {tuple(sizes)}, the local tensor is {local_shape}"
        )
    return tuple(slice(begin, begin + size) for begin, size in zip(begins, sizes, strict=True))


def _load_sharded(
    model_class: type[nn.Module],
    directory: Path,
    library: str,
    entries: list[_TensorEntry],
    device: torch.device,
    dtype: torch.dtype,
    keep_in_fp32: Sequence[str] | None,
    shard_model: Callable[[nn.Module], None],
    stats: LoadStats,
) -> nn.Module:
    """`load_pretrained` with `shard_model`: build empty, shard, allocate the shards, read only them."""
    model = _build_empty(model_class, directory, library, dtype)
    entries = _rename(entries, model, library)
    meta_state = model.state_dict(keep_vars=True)
    tied = _tied_keys(model)
    if tied:
        raise NotImplementedError(f"{model_class.__name__} ties weights ({_names(tied)}); load it whole")
    _check_keys(model_class, directory, meta_state, entries, set(meta_state), tied, False)
    keep_fp32 = _fp32_matcher(model if library == "transformers" else model_class, library, dtype, keep_in_fp32)
    target_dtype = functools.partial(_target_dtype, dtype, keep_fp32, meta_state if library == "transformers" else None)
    by_key = {entry.key: entry for entry in entries}

    # Parameters take their final dtype while still on the meta device, so that the sharding plan sees
    # what it will hold (FSDP2 groups parameters by dtype) and allocation makes them right at once.
    with torch.no_grad():
        for key, value in meta_state.items():
            if value.is_meta:
                _set_tensor(model, key, torch.empty_like(value, dtype=target_dtype(by_key[key])))
    real_buffers = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}

    shard_model(model)
    # Allocates every (local shard of a) parameter on the device, uninitialised; `to_empty` would also
    # replace the buffers `__init__` computed (RoPE tables), so those are put back.
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in real_buffers.items():
            path, _, attribute = name.rpartition(".")
            model.get_submodule(path)._buffers[attribute] = buffer.to(device)

    destinations: dict[str, tuple[torch.Tensor, tuple[slice, ...]]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in by_key:
            local = value.to_local() if isinstance(value, DTensor) else value
            destinations[key] = (local.data, _local_region(value))
    to_read = [by_key[key] for key in destinations]
    with _Reader(to_read, num_threads=stats.threads, stats=stats) as reader:
        reader.fill(to_read, target_dtype, destinations)

    stats.tensors = len(to_read)
    if library == "diffusers":
        model.register_to_config(_name_or_path=str(directory))
    full_bytes = sum(entry.nbytes for entry in entries)
    logger.info(
        "%s from %s: this rank read %.3f of %.3f GB (its shards)",
        model_class.__name__,
        directory,
        stats.total_bytes / 1e9,
        full_bytes / 1e9,
    )
    return model.eval()


def describe(model: nn.Module) -> dict[str, Any]:
    """`LoadStats` of a loaded model as plain JSON-able values, for logs and `stagediff info`."""
    stats = load_stats(model)
    return {
        "bytes": stats.total_bytes,
        "seconds": round(stats.seconds, 4),
        "gb_per_s": round(stats.gb_per_s, 3),
        "threads": stats.threads,
        "tensors": stats.tensors,
        "shards": len(stats.shards),
    }
