"""A small pool of threads of its own for clients' image files: header probes and whole decodes.

Parsing a client's file is never done on an event loop (it would stall every other caller) nor on a stage's
compute thread (it would stall the model): the orchestrator and the stages that see images hand each such
piece of work to an `ImageWorkers`, whose few threads do nothing else. Each piece of work gets a `Stop`
(services/images.py): its deadline runs from the moment a worker starts it, and a caller that is cancelled
(the client gave up, the job was cancelled, the stage call was cut) cancels it, so the worker drops it if it
has not started and ends it at its next block read if it has. No torch here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.images import Stop

T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_DEADLINE_S = 10.0  # per piece of work: one request's probes, or its decodes


class ImageWorkers:
    """Runs image work on `threads` dedicated threads, each piece under a deadline of `deadline_s`."""

    def __init__(self, threads: int = DEFAULT_THREADS, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if threads < 1 or deadline_s <= 0:
            raise ValueError(f"image workers: threads {threads} must be >= 1 and deadline_s {deadline_s} > 0")
        self.deadline_s = deadline_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="images")

    async def run(self, work: Callable[[Stop], T]) -> T:
        """`work(stop)` on a worker thread; cancelling the caller stops it (see the module's doc)."""
        stop = Stop(self.deadline_s)

        def started() -> T:
            stop.start()
            return work(stop)

        try:
            # The future is never a local: this frame is in the traceback of what the work raises, and a local
            # holding the future (which holds that exception) would make a cycle that keeps the work's bytes
            # (a 16 MiB image) until the cyclic collector runs.
            return await asyncio.get_running_loop().run_in_executor(self._executor, started)
        except asyncio.CancelledError:
            stop.cancel()
            raise

    def close(self) -> None:
        """Drops queued work and lets running work end at its next check."""
        self._executor.shutdown(wait=False, cancel_futures=True)
