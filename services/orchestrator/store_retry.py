"""Riding out a short outage of the job database: a store call that finds it unreachable is tried again.

A PostgreSQL restart or failover takes seconds. A running job's writes (its start, each finished stage's
output, its result) wait for it with backoff (`OUTAGE_DELAYS_S`, about 30 s in all) instead of failing the
job; past that, the job fails as on any store error and its row, still running, is requeued once its lease
expires. Admissions are not retried here: the client hears UNAVAILABLE with a retry delay
(refusals.py) and its SDK tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from services.orchestrator.store_errors import StoreUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
OUTAGE_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)


async def store_call(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)` in a thread, tried again while the store is unreachable."""
    for delay in (*OUTAGE_DELAYS_S, None):
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except StoreUnavailable as error:
            if delay is None:
                raise
            logger.warning("%s; trying again in %.1f s", error, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
