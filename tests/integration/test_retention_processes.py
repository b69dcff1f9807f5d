"""Retention belongs to tenants, and a full state volume or a failing store never leaks a slot.

The JobManager and Pipeline are the orchestrator's own, with the stage calls replaced (tests.test_result_spool's
FramePipeline); the store is real, and so is the full volume where this runs as root (a 2 MiB tmpfs).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import JobStore
from services.orchestrator.tenants import Tenant
from tests.helpers.result_pipeline import FramePipeline, make_request
from tests.helpers.store import FAILED, SUCCEEDED

VOLUME_BYTES = 2 << 20


@pytest.fixture
def small_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A state dir on a 2 MiB volume, where writing past the space left fails with ENOSPC.

    As root it is a tmpfs of that size, so the kernel refuses the write. Where mounting is not allowed,
    os.pwrite (how the store writes results) is wrapped to refuse writes that end past 2 MiB in a file.
    """
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={VOLUME_BYTES}", "tmpfs", str(volume)], capture_output=True
    )
    if mounted.returncode != 0:
        pwrite = os.pwrite

        def pwrite_within_the_volume(fd: int, data, offset: int) -> int:
            if offset + len(data) > VOLUME_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite_within_the_volume)
    try:
        yield volume / "state"
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(volume)], check=True)


def test_a_full_volume_fails_the_running_job_cleanly_and_the_next_one_runs(small_volume: Path) -> None:
    async def scenario() -> None:
        with JobStore.open(small_volume) as store:
            scheduler = FairScheduler(max_running=1)
            jobs = JobManager(FramePipeline(store).run, scheduler, store)
            tenant = Tenant(name="acme")
            # 3 MiB of frames on a 2 MiB volume, then a small job queued behind it.
            big, _ = await jobs.submit(make_request(65, 128, 128), tenant)
            small, _ = await jobs.submit(make_request(5), tenant)
            assert scheduler.is_queued(small.job_id)
            await big.task
            assert big.state == FAILED and big.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "state volume is full" in big.error_message and "No space left" in big.error_message
            assert store.get(big.job_id).state == FAILED
            assert not (store.jobs_dir / big.job_id).exists() or os.listdir(store.jobs_dir / big.job_id) == []
            # Its slot went to the next job, which ran to the end.
            await small.task
            assert small.state == SUCCEEDED, small.error_message
            assert scheduler.running_count() == 0 and scheduler.depth() == 0

    asyncio.run(scenario())
