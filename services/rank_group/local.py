"""This node's ranks: joining torch.distributed, and the follower rank processes that handle each message
the group's lead hands them (over a multiprocessing queue per rank) and reply on a shared queue."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from services.rank_group.settings import COLLECTIVE_TIMEOUT, GroupSettings, WorkerFactory
from stagekit.errors import Cancelled

logger = logging.getLogger(__name__)


def join_group(rank: int, settings: GroupSettings) -> torch.device:
    """Initialises torch.distributed for this rank: NCCL on GPUs, gloo on the CPU."""
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    if settings.device == "cuda":
        device = torch.device("cuda", (rank % settings.ranks_per_node) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    host = f"[{settings.master_addr}]" if ":" in settings.master_addr else settings.master_addr
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{settings.master_port}",
        rank=rank,
        world_size=settings.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return device


def _next_message(inbox: Any, parent: int) -> Any:
    """The next message, or None (stop) once the process that started this rank is gone: killed without a
    chance to say stop, it leaves the rank nobody to follow."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def follower_main(
    rank: int, settings: GroupSettings, factory: WorkerFactory, payload: Any, inbox: Any, replies: Any
) -> None:
    """A follower rank: build the worker, then handle every message rank 0 hands over until told to stop.

    SIGTERM and SIGINT are rank 0's to answer. They reach this process too when they are sent to the service's
    whole process group (Ctrl-C in a terminal, `kill -- -PGID`), and this rank takes part in the calls rank 0
    drains: it stops when rank 0 says so, or once rank 0 is gone.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        device = join_group(rank, settings)
        worker = factory(rank, device, payload)
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    replies.put((rank, "ready", None))
    while (message := _next_message(inbox, parent)) is not None:
        try:
            worker.handle(message)
            replies.put((rank, "done", None))
        except Cancelled:
            replies.put((rank, "cancelled", None))
        except BaseException:
            # Leave the group: rank 0's pending collectives then fail at once instead of timing out.
            replies.put((rank, "error", traceback.format_exc()))
            return
    dist.destroy_process_group()
    gc.freeze()  # the process exits next: its teardown skips collecting the heap (services/server.py `serve`)


def spawn_followers(
    settings: GroupSettings, ranks: range, factory: WorkerFactory, payload: Any
) -> tuple[Any, dict[int, Any], dict[int, BaseProcess]]:
    """Starts `ranks` as follower processes: (their shared replies queue, an inbox per rank, the processes)."""
    context = multiprocessing.get_context("spawn")
    replies = context.Queue()
    inboxes = {rank: context.Queue() for rank in ranks}
    followers: dict[int, BaseProcess] = {
        rank: context.Process(
            target=follower_main, args=(rank, settings, factory, payload, inboxes[rank], replies), daemon=True
        )
        for rank in ranks
    }
    for process in followers.values():
        process.start()
    if followers:
        pids = [process.pid for process in followers.values()]
        logger.info("%s: started ranks %d..%d (pids %s)", settings.name, ranks[0], ranks[-1], pids)
    return replies, inboxes, followers


def dead_follower(name: str, followers: dict[int, BaseProcess]) -> str | None:
    for rank, process in followers.items():
        if process.exitcode is not None:
            return f"{name} rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
    return None


def stop_followers(inboxes: dict[int, Any], followers: dict[int, BaseProcess], wait_s: float) -> None:
    """Tells every follower to stop, gives them `wait_s` in all to leave the group, then kills the rest."""
    for inbox in inboxes.values():
        inbox.put(None)
    deadline = time.monotonic() + wait_s
    for process in followers.values():
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
