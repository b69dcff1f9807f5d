"""Finished stages' outputs written to the job store behind the job, so that a cut run resumes after them.

A kept output (pipeline.KEPT_OUTPUTS) costs a blob write and a transaction, and the job's commit deletes it
again: for a job that ends within a second that is work for nothing, and with PostgreSQL and S3 a large share
of a short job's cost. So each output waits `after_s` (--keep-outputs-after) before it is written:

- The commit `settle`s the job's writes: those still waiting are dropped, those under way are awaited (before
  the result is committed, which drops every intermediate; none may land after it).
- A run stopped to run again elsewhere or later (the replica hands its jobs back, or shuts down) `flush`es
  them: the waiting ones are written at once.
- A run that ends otherwise (failed, cancelled, or its lease lost) `drop`s the waiting ones: the store keeps
  no intermediate of a finished job, and a lost lease fences every write.

A crash within `after_s` of a stage's end runs that stage again; at 0 every output is written as soon as its
stage ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)

DEFAULT_AFTER_S = 1.0


class PendingWrite:
    """One stage output's write, begun after `after_s` or when flushed."""

    def __init__(self, write: Callable[[], Awaitable[bool]], after_s: float, name: str) -> None:
        self._now = asyncio.Event()
        self.begun = after_s <= 0  # written at once: nothing waits, so nothing may be dropped
        self.task = asyncio.create_task(self._run(write, after_s), name=name)
        self.task.add_done_callback(_logged)  # a job that ends before its commit never awaits it

    async def _run(self, write: Callable[[], Awaitable[bool]], after_s: float) -> bool:
        if after_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), after_s)
        self.begun = True
        return await write()

    def begin_now(self) -> None:
        """Ends the wait: the write begins at once."""
        self._now.set()

    def drop(self) -> None:
        """Cancels the write unless it has begun."""
        if not self.begun:
            self.task.cancel()


async def settle(writes: Iterable[PendingWrite]) -> None:
    """At the commit: drops the writes still waiting and waits for those under way (raising what they raised)."""
    begun = []
    for write in writes:
        write.drop()
        if write.begun:
            begun.append(write.task)
    await asyncio.gather(*begun)


async def flush(writes: Iterable[PendingWrite]) -> None:
    """Writes the waiting outputs now and waits for every write (failures are logged, not raised)."""
    tasks = []
    for write in writes:
        write.begin_now()
        tasks.append(write.task)
    await asyncio.gather(*tasks, return_exceptions=True)


def drop(writes: Iterable[PendingWrite]) -> None:
    """Cancels the writes still waiting."""
    for write in writes:
        write.drop()


def _logged(task: asyncio.Task[bool]) -> None:
    """Reads a write's outcome, so that a failure nobody awaited is logged, not warned about."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("saving a stage output failed: %s", task.exception())
