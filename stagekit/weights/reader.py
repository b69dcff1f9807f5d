"""The thread pool that reads safetensors files through private (copy-on-write) mappings.

Each file is mapped once. `prefetch` faults every page in while the model is still being built; then a tensor
that needs no cast on the CPU stays a view of the mapping (the page cache's own pages, resident when loading
returns), and any other is cast to its final dtype or moved to its final device once, straight from the
mapping. Writing to a loaded weight copies that page; the file is never changed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from stagekit.weights.keys import TensorEntry, read_headers
from stagekit.weights.stats import LoadStats, ShardStats

logger = logging.getLogger(__name__)


def read_safetensors(path: str | os.PathLike[str], num_threads: int = 4) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on the CPU as stored, read by the same thread pool as a checkpoint
    (for files that fill no model of their own, such as LoRA adapters). The tensors are views of the file's
    private mapping, resident when this returns."""
    entries = read_headers([Path(path)])
    stats = LoadStats(threads=num_threads)
    with Reader(entries, num_threads, stats) as reader:
        return reader.collect(reader.start(entries, lambda entry: entry.dtype, torch.device("cpu")), entries)


def _map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private (copy-on-write) mapping: nothing is read yet."""
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), False, size)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))


def _view(mapped: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """`entry` as a tensor over the mapping (a private copy if its offset is not aligned to its dtype)."""
    raw = mapped[entry.offset : entry.offset + entry.nbytes]
    if entry.offset % entry.dtype.itemsize:
        raw = raw.clone()
    return raw.view(entry.dtype).reshape(entry.shape)


def _plan_tasks(entries: list[TensorEntry], num_threads: int) -> list[list[TensorEntry]]:
    """Groups of tensors of one file each, balanced by bytes, enough of them to keep every thread busy.

    Files are cut into pieces of at most total / (2 * threads) bytes, and the pieces are ordered
    largest first so that the last piece to finish is a small one.
    """
    by_file: dict[Path, list[TensorEntry]] = defaultdict(list)
    for entry in entries:
        by_file[entry.file].append(entry)
    if num_threads == 1:
        return [sorted(group, key=lambda e: e.offset) for group in by_file.values()]
    total = sum(e.nbytes for e in entries)
    piece = max(1, total // (2 * num_threads))
    tasks: list[list[TensorEntry]] = []
    for group in by_file.values():
        current: list[TensorEntry] = []
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


class Reader:
    """The thread pool that reads a checkpoint's files, mapped once each (private, copy-on-write).

    `prefetch` faults every page of every file into the mappings in the background: it needs no model,
    so it runs while the model is being built. `load` then turns entries into tensors: a tensor that
    needs no cast on the CPU stays a view of the mapping, the page cache's own pages (no copy, as
    safetensors and both libraries' from_pretrained leave it, but here resident when loading returns);
    any other is cast or moved once, straight from the mapping.
    """

    def __init__(self, entries: list[TensorEntry], num_threads: int, stats: LoadStats) -> None:
        self.entries = entries
        self.num_threads = num_threads
        self.stats = stats
        self.mapped = {path: _map_file(path) for path in dict.fromkeys(entry.file for entry in entries)}
        self.pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="weights")
        self.prefetched: list[Future[None]] = []
        self.lock = threading.Lock()
        self.file_times: dict[Path, list[float]] = {}
        self.page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> Reader:
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
        entries: list[TensorEntry],
        target_dtype: Callable[[TensorEntry], torch.dtype],
        device: torch.device,
    ) -> list[Future[dict[str, torch.Tensor]]]:
        """Begin turning `entries` into tensors in their target dtype on `device`; `collect` gathers them."""
        resident = bool(self.prefetched)
        on_cpu = device.type == "cpu"

        def run(task: list[TensorEntry]) -> dict[str, torch.Tensor]:
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
        entries: list[TensorEntry],
        target_dtype: Callable[[TensorEntry], torch.dtype],
        destinations: dict[str, list[tuple[torch.Tensor, tuple[slice, ...]]]],
    ) -> None:
        """Copies each (destination, region) of each entry: the `region` of the entry into its allocated
        destination (cast on the destination's device); a packed shard has several."""

        def run(task: list[TensorEntry]) -> None:
            t0 = time.perf_counter()
            for entry in task:
                for destination, region in destinations[entry.key]:
                    if destination.dtype != target_dtype(entry):
                        raise ValueError(
                            f"{entry.key}: allocated as {destination.dtype}, loads as {target_dtype(entry)}"
                        )
                    if entry.nbytes:
                        destination.copy_(_view(self.mapped[entry.file], entry)[region])
            self._timed(task[0].file, t0)

        futures = [self.pool.submit(run, task) for task in _plan_tasks(entries, self.num_threads)]
        for future in futures:
            future.result()
        self._account(
            entries, lambda entry: sum(part.numel() for part, _ in destinations[entry.key]) * entry.dtype.itemsize
        )

    def collect(
        self, futures: list[Future[dict[str, torch.Tensor]]], entries: list[TensorEntry]
    ) -> dict[str, torch.Tensor]:
        """The tensors `start` made, keyed by model key; logs what each file cost."""
        state: dict[str, torch.Tensor] = {}
        for future in futures:
            state.update(future.result())
        for prefetched in self.prefetched:
            prefetched.result()
        self._account(entries, lambda entry: entry.nbytes)
        return state

    def _account(self, entries: list[TensorEntry], nbytes_read: Callable[[TensorEntry], int]) -> None:
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
