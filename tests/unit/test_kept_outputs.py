"""Kept stage outputs are written behind the job (services/orchestrator/kept_outputs.py): after their delay,
at once when flushed, never once dropped or settled before they began."""

from __future__ import annotations

import asyncio

import pytest

from services.orchestrator.kept_outputs import PendingWrite, drop, flush, settle


class Writes:
    """Records each write it is asked for."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def of(self, name: str, after_s: float) -> PendingWrite:
        async def write() -> bool:
            self.done.append(name)
            return True

        return PendingWrite(write, after_s, name=name)


def test_a_write_waits_its_delay_and_a_commit_drops_it_before_it_begins() -> None:
    async def scenario() -> None:
        writes = Writes()
        soon, late = writes.of("soon", 0.01), writes.of("late", 3600)
        await soon.task
        assert writes.done == ["soon"]
        await settle([soon, late])  # the commit: `late` never began, so it is dropped
        await asyncio.gather(late.task, return_exceptions=True)
        assert late.task.cancelled() and writes.done == ["soon"]

    asyncio.run(scenario())


def test_a_write_without_delay_is_never_dropped() -> None:
    async def scenario() -> None:
        writes = Writes()
        now = writes.of("now", 0)
        await settle([now])  # before the task ran at all: still written
        assert writes.done == ["now"]

    asyncio.run(scenario())


def test_flush_writes_the_waiting_outputs_at_once_and_drop_cancels_them() -> None:
    async def scenario() -> None:
        writes = Writes()
        flushed, dropped = [writes.of("a", 3600), writes.of("b", 3600)], writes.of("c", 3600)
        await flush(flushed)
        assert writes.done == ["a", "b"]
        drop([dropped])
        await asyncio.gather(dropped.task, return_exceptions=True)
        assert dropped.task.cancelled() and writes.done == ["a", "b"]

    asyncio.run(scenario())


def test_settle_raises_what_a_begun_write_raised() -> None:
    async def failing() -> bool:
        raise OSError("the store is gone")

    async def scenario() -> None:
        write = PendingWrite(failing, 0, name="failing")
        with pytest.raises(OSError, match="the store is gone"):
            await settle([write])

    asyncio.run(scenario())
