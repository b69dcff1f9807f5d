"""Each tenant's `requests_per_minute`, as a token bucket per tenant.

A bucket holds the tenant's `burst` tokens and refills at requests_per_minute / 60 tokens a second; a
request takes one, and a refused request takes nothing. The clock (monotonic seconds) is injectable so that
tests can move time by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.orchestrator.tenants.schema import Tenant

Clock = Callable[[], float]


@dataclass
class _Bucket:
    capacity: int
    per_second: float
    tokens: float
    updated: float


class RateLimiter:
    """Per-tenant token buckets for `requests_per_minute`.

    Each tenant's bucket holds `burst` tokens and refills at
    requests_per_minute / 60 tokens a second; a request takes one. `clock`
    (monotonic seconds) is injectable so that tests can move time by hand.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, tenant: Tenant) -> _Bucket | None:
        capacity = tenant.quotas.bucket_capacity
        rate = tenant.quotas.requests_per_minute
        if capacity is None or rate is None:
            return None
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = _Bucket(capacity, rate / 60.0, float(capacity), self.clock())
            self._buckets[tenant.name] = bucket
        return bucket

    def acquire(self, tenant: Tenant) -> float:
        """Takes a token for one request: 0.0 when accepted, else the seconds until one would be.

        A refused request takes nothing, so a client that waits the returned
        time is accepted then (if no other request of the tenant came first).
        """
        bucket = self._bucket(tenant)
        if bucket is None:
            return 0.0
        now = self.clock()
        elapsed = max(0.0, now - bucket.updated)
        bucket.tokens = min(bucket.capacity, bucket.tokens + elapsed * bucket.per_second)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / bucket.per_second
