"""A stage's process group: rank 0 serves gRPC, the other ranks follow it.

A stage with a parallel layout (the DiT's sequence/tensor/CFG parallelism, the
VAE's patch parallelism) starts its other ranks itself, with the spawn method:
a fresh interpreter each, so nothing of rank 0's gRPC state is inherited. Each
rank builds the same `RankWorker` (load the model, apply the layout). Work
reaches the followers over a multiprocessing queue rather than a collective, so
an idle group is not a collective waiting to time out; then every rank runs the
same computation in step, with collectives inside it, and rank 0 alone answers.

A follower that dies leaves the group unable to compute: `failure()` says so,
the stage's health turns NOT_SERVING, and calls fail with UNAVAILABLE instead of
hanging.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from services.stage import Cancelled

logger = logging.getLogger(__name__)

# A single collective never takes this long when every rank is alive; a dead
# peer usually fails the collective at once, this bounds the other cases.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 600.0
T = TypeVar("T")


class RankWorker(Protocol):
    """What every rank runs for each message; collectives inside keep the ranks in step."""

    def handle(self, message: Any) -> Any: ...


# Builds a rank's worker: (rank, device, payload) -> RankWorker. Must be a module-level
# function, since follower ranks import it by name.
WorkerFactory = Callable[[int, torch.device, Any], RankWorker]


@dataclass(frozen=True)
class GroupSettings:
    name: str  # the stage, for log lines and errors
    world_size: int
    device: str  # "cpu" or "cuda": each rank takes cuda:<rank> on accelerators
    threads: int
    master_port: int


class GroupFailure(RuntimeError):
    """The group lost a rank or a rank failed; the stage cannot compute any more."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_group(rank: int, settings: GroupSettings) -> torch.device:
    """Initialises torch.distributed for this rank: NCCL on GPUs, gloo on the CPU."""
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    if settings.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{settings.master_port}",
        rank=rank,
        world_size=settings.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return device


def follower_main(rank: int, settings: GroupSettings, factory: WorkerFactory, payload: Any, inbox, replies) -> None:
    """A follower rank: build the worker, then handle every message rank 0 hands over until told to stop."""
    try:
        device = join_group(rank, settings)
        worker = factory(rank, device, payload)
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    replies.put((rank, "ready", None))
    while (message := inbox.get()) is not None:
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


class RankGroup:
    """Rank 0's view of the group."""

    def __init__(self, settings: GroupSettings, factory: WorkerFactory, payload: Any) -> None:
        self.settings = settings
        context = multiprocessing.get_context("spawn")
        self.replies = context.Queue()
        self.inboxes = [context.Queue() for _ in range(1, settings.world_size)]
        self.followers = [
            context.Process(
                target=follower_main,
                args=(rank, settings, factory, payload, self.inboxes[rank - 1], self.replies),
                daemon=True,
            )
            for rank in range(1, settings.world_size)
        ]
        for process in self.followers:
            process.start()
        logger.info(
            "%s: started ranks 1..%d (pids %s)", settings.name, len(self.followers), [p.pid for p in self.followers]
        )
        self.device = join_group(0, settings)
        self.worker = factory(0, self.device, payload)
        self._await_replies(STARTUP_TIMEOUT_S)
        logger.info("%s: group of %d ranks ready", settings.name, settings.world_size)

    def failure(self) -> str | None:
        """Why the group can no longer compute, or None while every follower lives."""
        for rank, process in enumerate(self.followers, start=1):
            if process.exitcode is not None:
                return f"{self.settings.name} rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def run(self, message: Any, lead: Callable[[], T]) -> T:
        """Hands `message` to every follower and runs `lead` (rank 0's part of the same work) meanwhile."""
        if (reason := self.failure()) is not None:
            raise GroupFailure(reason)
        for inbox in self.inboxes:
            inbox.put(message)
        try:
            result = lead()
        except Cancelled:
            self._await_replies(COLLECTIVE_TIMEOUT.total_seconds())
            raise
        except Exception as error:
            raise GroupFailure(self.failure() or f"{self.settings.name} rank 0 failed: {error}") from error
        self._await_replies(COLLECTIVE_TIMEOUT.total_seconds())
        return result

    def _await_replies(self, timeout: float) -> None:
        """Waits for every follower's reply, failing fast when one dies or reports an error."""
        waiting = set(range(1, self.settings.world_size))
        deadline = time.monotonic() + timeout
        while waiting:
            if (reason := self.failure()) is not None:
                raise GroupFailure(reason)
            if time.monotonic() > deadline:
                late = sorted(waiting)
                raise GroupFailure(f"{self.settings.name} ranks {late} did not answer within {timeout:.0f} s")
            try:
                rank, status, detail = self.replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if status == "error":
                raise GroupFailure(f"{self.settings.name} rank {rank} failed:\n{detail}")
            waiting.discard(rank)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.followers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
