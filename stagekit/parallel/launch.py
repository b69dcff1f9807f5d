"""Runs a function on N local ranks in a gloo process group and collects what each returns.

For tests and benchmarks of parallel code on one machine: `run_ranks(fn, world_size, *args)`
calls `fn(rank, world_size, *args)` on every rank; fn must be a module-level function
(spawned processes import it by name). Each rank gets `threads` intra-op threads (one by
default), so that ranks do not fight over the cores. The serving stage starts its ranks
itself (dit_svc/group.py).
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _as_bytes(value: Any) -> bytes:
    """`value` serialized with torch.save: tensors put on a queue as they are travel as file descriptors
    that the receiver fetches from the sending process, which may have exited by then."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(rank: int, world_size: int, threads: int, init_file: str, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", _as_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # The process exits next: frozen, its heap is left out of the interpreter teardown's collections (seconds
    # with torch and the model libraries imported).
    gc.freeze()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, threads: int = 1
) -> list[Any]:
    """Returns [fn's result on rank 0, rank 1, ...]; raises with the failing rank's traceback."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        processes = [
            context.Process(target=_worker, args=(rank, world_size, threads, init_file, fn, args, results))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        collected: dict[int, Any] = {}
        try:
            while len(collected) < world_size:
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                # Our own child's output, so a full unpickle is safe.
                collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    return [collected[rank] for rank in range(world_size)]
