"""The blob janitor: with a blob store, deletes now and then the blobs no job row names.

Rows name only complete blobs, and a job's blobs are deleted with its row; what is left over comes from a
replica that crashed or lost its lease between writing a blob and committing the row that names it, or from a
delete that failed while the store was unreachable. `JobStore.collect_garbage` finds those by listing every
blob (so it runs rarely, in a thread, never on the event loop) and keeps the young ones a live replica is
about to commit. Uploads never completed are the bucket's lifecycle rule's to reap
(`AbortIncompleteMultipartUpload`, docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.orchestrator.store import JobStore

logger = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 3600.0


class BlobJanitor:
    """Runs `collect_garbage` at start and every `interval_s` while started."""

    def __init__(self, store: JobStore, interval_s: float = JANITOR_INTERVAL_S) -> None:
        self.store = store
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.store.files.blobs is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="blob-janitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                deleted = await asyncio.to_thread(self.store.collect_garbage)
                if deleted:
                    logger.info("deleted %d blobs no job names", deleted)
            except Exception as error:  # the store is unreachable now: try again at the next round
                logger.warning("the blob janitor could not run: %s", error)
            await asyncio.sleep(self.interval_s)
