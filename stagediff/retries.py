"""When a client call is tried again: `RetryPolicy`, and `Retries`, the retries left to one call under it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import grpc

from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.status_details import retry_after


@dataclass
class RetryPolicy:
    """When a call is tried again.

    UNAVAILABLE (the orchestrator restarting, a dropped connection): exponential backoff, initial,
    initial*multiplier, ... capped at maximum, for `max_attempts` tries in all. The default waits about 24 s
    in all (0.5, 1, 2, 4, 8, 8), enough to ride out an orchestrator restart. Where the server says when to
    retry (a RetryInfo: a takeover between orchestrator replicas, the job database restarting), its delay is
    taken instead, as often as fits in the same total wait.

    RESOURCE_EXHAUSTED (a rate limit, a full queue): up to `rate_limit_retries` more tries, each after the
    server's RetryInfo delay (or, where it gave none, the backoff above), as long as the waits add up to at
    most `rate_limit_max_wait_s`; a delay that would go past it ends the retries at once and raises
    RateLimitError with the server's `retry_after`. 0 retries disables them.

    Generate, Submit and the job calls are retried only when safe: a generate call carries a request id,
    so a retry attaches to the job the first try made. A job's own failure is never retried.
    """

    max_attempts: int = 7
    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 8.0
    rate_limit_retries: int = 3
    rate_limit_max_wait_s: float = 60.0

    def delays(self) -> Iterator[float]:
        """The backoff before each UNAVAILABLE retry: max_attempts - 1 delays."""
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield delay
            delay = min(delay * self.multiplier, self.max_backoff_s)


class Retries:
    """The retries left to one call under a RetryPolicy."""

    def __init__(self, policy: RetryPolicy, allowed: bool = True) -> None:
        self.policy = policy
        self.allowed = allowed
        self.unavailable_delays = policy.delays()
        self.unavailable_budget = sum(policy.delays())
        self.unavailable_waited = 0.0
        self.rate_limit_tries = 0
        self.rate_limit_waited = 0.0

    def delay(self, error: grpc.aio.AioRpcError) -> float | None:
        """Seconds to wait before trying the call again after `error`, or None to give up and raise it."""
        if not self.allowed or is_job_outcome(error):
            return None
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            asked = retry_after(error)
            if asked is not None and self.unavailable_waited + asked <= self.unavailable_budget:
                self.unavailable_waited += asked
                return asked
            delay = next(self.unavailable_delays, None)
            if delay is not None:
                self.unavailable_waited += delay
            return delay
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        if self.rate_limit_tries >= self.policy.rate_limit_retries:
            return None
        wait = retry_after(error)
        if wait is None:
            backoff = self.policy.initial_backoff_s * self.policy.multiplier**self.rate_limit_tries
            wait = min(backoff, self.policy.max_backoff_s)
        if self.rate_limit_waited + wait > self.policy.rate_limit_max_wait_s:
            return None
        self.rate_limit_tries += 1
        self.rate_limit_waited += wait
        return wait


def is_job_outcome(error: grpc.aio.AioRpcError) -> bool:
    """Whether `error` is a job's own failure (marked in trailing metadata), which is never retried."""
    # An aio call's trailing metadata iterates as (key, value) pairs; grpc-stubs types the sync call's.
    metadata = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    return any(key == JOB_FAILED_METADATA_KEY for key, _ in metadata)
