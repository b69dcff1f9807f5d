"""Which queued job runs next: strict priority classes, weighted fair sharing of tenants inside a class.

Priority classes are strict: a job of a higher class always starts before any job of a lower one, as long as its
tenant may start another job (on its model). Inside a class, tenants share job slots in proportion to their
weights by start-time fair queueing (SFQ, Goyal et al. 1996) with a cost of one per job:
- each class has a virtual time V, the start tag of the job it dispatched last;
- each tenant has a finish tag F, the finish tag of its last dispatched job;
- a tenant's next job has the start tag S = max(V, F); the job with the smallest S starts (ties: the job
  admitted first), then F = S + 1 / weight and V = S.

Tags are computed at dispatch, not arrival, so a tenant that was idle or at its own running limit comes back at
S = V, with no credit saved up. Among backlogged tenants the normalised counts n_i / w_i differ by at most
max(1/w_i, 1/w_j), and a waiting tenant x sees at most ceil(w_j / w_x) + 1 jobs of each other tenant j start
before its own. Tags are exact fractions, so ties are real ties and the order is deterministic.

Each job is for a model, and a tenant may have limits per model besides its own (`TenantLimits.per_model`).
A tenant's candidate in its class is its first queued job, in admission order, that may start: its jobs on a
model where it is at its running limit wait, and the next one on another model goes instead. All of a tenant's
jobs share its finish tag, so a per-model limit changes which of its jobs starts, never its share; a tenant
whose every queued model is at its limit is skipped like one at its own limit, and comes back at S = V too.

Admission refuses a job (`AdmissionRefused`, with a retry-after estimate) when the queue, the tenant's share of
it or the tenant's share on the job's model is full; a tenant at its limit of running jobs is skipped by
`next_runnable`. Pure bookkeeping: no asyncio, no threads, no wall clock but the injectable `clock` for
retry-after estimates. Each call costs O(tenants in a class x the models each has queued jobs on); `positions`
costs O(queued x tenants).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from fractions import Fraction
from typing import TypeAlias, TypeVar

_Key = TypeVar("_Key")

MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6


class Priority(IntEnum):
    """Priority classes; a higher value always goes first."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, value: str | int) -> Priority:
        """Accepts a Priority, its name in any case ("high", "normal", "low") or its integer rank."""
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"priority: '{value}' is not one of {', '.join(PRIORITY_NAMES)}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"priority: {value} is not one of {[int(p) for p in cls]}") from None


# Class names from the highest class to the lowest.
PRIORITY_NAMES = tuple(p.name.lower() for p in sorted(Priority, reverse=True))


@dataclass(frozen=True)
class JobLimits:
    """Limits on a set of jobs (a tenant's, or a tenant's on one model); None means unlimited."""

    max_queued: int | None = None
    max_running: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queued", "max_running"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value}; must be at least 1, or None for no limit")


@dataclass(frozen=True)
class TenantLimits(JobLimits):
    """Per-tenant admission limits, and those of its jobs on each model in `per_model` (model id -> limits;
    a model it does not name, and the model "", has no limits of its own)."""

    per_model: Mapping[str, JobLimits] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if "" in self.per_model:
            raise ValueError("per_model: the model '' (no model) takes no limits of its own")


@dataclass(frozen=True)
class TenantCounts:
    queued: int
    running: int


class AdmissionRefused(Exception):
    """A job was not admitted because a queue limit is reached.

    `scope` is "global" (the whole queue is full), "tenant" (the tenant's
    share is full) or "model" (the tenant's share on the job's model, `model`,
    is full); `retry_after_s` estimates when a retry may be admitted, for a
    RESOURCE_EXHAUSTED status with RetryInfo.
    """

    def __init__(self, message: str, *, retry_after_s: float, scope: str, tenant: str, model: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.scope = scope
        self.tenant = tenant
        self.model = model


@dataclass
class _Entry:
    job_id: str
    tenant: str
    model: str
    priority: Priority
    seq: int  # admission order, the tie-breaker


@dataclass
class _Tenant:
    weight: Fraction
    limits: TenantLimits
    queued: int = 0
    running: int = 0
    # The same counts per model; only models with queued (running) jobs appear.
    queued_on: Counter[str] = field(default_factory=Counter)
    running_on: Counter[str] = field(default_factory=Counter)

    def may_start(self) -> bool:
        return self.limits.max_running is None or self.running < self.limits.max_running

    def may_start_on(self, model: str) -> bool:
        limits = self.limits.per_model.get(model)
        return limits is None or limits.max_running is None or self.running_on[model] < limits.max_running


# model -> a tenant's queued jobs on it, in admission order.
_ByModel: TypeAlias = dict[str, OrderedDict[str, _Entry]]


@dataclass
class _Class:
    """One priority class: its virtual time, the tenants' finish tags and their queues."""

    vtime: Fraction = Fraction(0)
    finish: dict[str, Fraction] = field(default_factory=dict)
    # tenant -> model -> its queued jobs on the model in admission order; only non-empty queues appear.
    queues: dict[str, _ByModel] = field(default_factory=dict)


def _as_weight(weight: float | Fraction) -> Fraction:
    if isinstance(weight, bool) or not isinstance(weight, int | float | Fraction) or not math.isfinite(weight):
        raise ValueError(f"weight: {weight!r} is not a finite number")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ValueError(f"weight: {weight}; must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}")
    # Bounded denominators keep the tag arithmetic exact and cheap.
    return Fraction(weight).limit_denominator(1_000_000)


def _pick(
    vtime: Fraction, finish: dict[str, Fraction], heads: Iterable[tuple[str, _Entry]]
) -> tuple[_Entry, Fraction] | None:
    """The head job with the smallest start tag max(V, F) among the tenants' candidates, and that tag."""
    best: tuple[Fraction, int, _Entry] | None = None
    for tenant, entry in heads:
        start = max(vtime, finish.get(tenant, vtime))
        if best is None or (start, entry.seq) < best[:2]:
            best = (start, entry.seq, entry)
    return None if best is None else (best[2], best[0])


def _first(queue: OrderedDict[str, _Entry]) -> _Entry:
    return next(iter(queue.values()))


def _in_admission_order(by_model: _ByModel) -> Iterator[_Entry]:
    """A tenant's queued jobs of one class over all its models, in admission order."""
    return heapq.merge(*(queue.values() for queue in by_model.values()), key=lambda entry: entry.seq)


def _decrement(counts: Counter[_Key], key: _Key) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


class FairScheduler:
    """The queue of admitted jobs and the set of running ones, by job id.

    Lifecycle of a job id: `admit` -> (`remove` while queued) or `next_runnable`
    returns it -> `finished`. Limits: `max_queued` over all tenants (None: no
    limit), `max_running` over all tenants (None: the caller limits concurrency
    itself), and each tenant's `TenantLimits` (its own, and per model) as given
    with its latest `admit`.

    With `max_running_from_the_top` (the orchestrator's --preemption on), `max_running` counts the running jobs
    of a job's class and the classes above it: jobs of lower classes never keep a higher one from starting. The
    DiT gate then decides who denoises (a lower class may have to yield), so a `high` job is never stuck behind
    `low` ones waiting for a DiT; at most `max_running` jobs of each class and above run, so at most
    `max_running` x the classes in all.
    """

    def __init__(
        self,
        *,
        max_queued: int | None = 256,
        max_running: int | None = None,
        max_running_from_the_top: bool = False,
        clock: Callable[[], float] = time.monotonic,
        default_job_seconds: float = 30.0,
        duration_window: int = 32,
        min_retry_after_s: float = 1.0,
        max_retry_after_s: float = 3600.0,
    ) -> None:
        self.max_queued = max_queued
        self.max_running = max_running
        self.max_running_from_the_top = max_running_from_the_top
        self.clock = clock
        self.default_job_seconds = default_job_seconds
        self.min_retry_after_s = min_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._classes = {priority: _Class() for priority in Priority}
        self._tenants: dict[str, _Tenant] = {}
        self._queued: dict[str, _Entry] = {}
        self._running: dict[str, tuple[str, str, float]] = {}  # job_id -> (tenant, model, start time)
        self._running_classes: Counter[Priority] = Counter()  # running jobs per class
        self._class_of: dict[str, Priority] = {}  # running job -> its class
        self._durations: deque[float] = deque(maxlen=duration_window)
        self._seq = 0

    # ------------------------------------------------------------ changes --

    def admit(
        self,
        job_id: str,
        tenant: str,
        priority: str | int = Priority.NORMAL,
        weight: float = 1.0,
        limits: TenantLimits | None = None,
        *,
        model: str = "",
        check_limits: bool = True,
    ) -> None:
        """Queues a job for `model`, or raises AdmissionRefused when a queue limit is reached.

        `weight` and `limits` become the tenant's current ones; `limits.per_model[model]`
        bounds the tenant's jobs on `model` ("": no per-model limits). `check_limits=False`
        admits regardless of the queue limits: for jobs recovered after a restart,
        which were admitted once already.
        """
        if job_id in self._queued or job_id in self._running:
            raise ValueError(f"job {job_id} is already admitted")
        rank = Priority.parse(priority)
        share = _as_weight(weight)
        limits = limits or TenantLimits()
        state = self._tenants.get(tenant)
        if check_limits:
            if self.max_queued is not None and len(self._queued) >= self.max_queued:
                raise AdmissionRefused(
                    f"the queue holds {len(self._queued)} jobs, its limit; retry later",
                    retry_after_s=self.retry_after(),
                    scope="global",
                    tenant=tenant,
                )
            queued = state.queued if state else 0
            if limits.max_queued is not None and queued >= limits.max_queued:
                raise AdmissionRefused(
                    f"tenant '{tenant}' has {queued} queued jobs, its limit; retry later",
                    retry_after_s=self.retry_after(tenant),
                    scope="tenant",
                    tenant=tenant,
                )
            on_model = limits.per_model.get(model)
            queued_on = state.queued_on[model] if state else 0
            if on_model is not None and on_model.max_queued is not None and queued_on >= on_model.max_queued:
                raise AdmissionRefused(
                    f"tenant '{tenant}' has {queued_on} queued jobs on model '{model}', its limit there; retry later",
                    retry_after_s=self.retry_after(tenant, model),
                    scope="model",
                    tenant=tenant,
                    model=model,
                )
        if state is None:
            state = self._tenants[tenant] = _Tenant(share, limits)
        state.weight, state.limits = share, limits
        state.queued += 1
        state.queued_on[model] += 1
        self._seq += 1
        entry = _Entry(job_id, tenant, model, rank, self._seq)
        self._queued[job_id] = entry
        self._classes[rank].queues.setdefault(tenant, {}).setdefault(model, OrderedDict())[job_id] = entry

    def _full_for(self, priority: Priority) -> bool:
        """Whether `max_running` keeps a job of `priority` from starting."""
        if self.max_running is None:
            return False
        if not self.max_running_from_the_top:
            return len(self._running) >= self.max_running
        above = sum(count for rank, count in self._running_classes.items() if rank >= priority)
        return above >= self.max_running

    def next_runnable(self) -> str | None:
        """Takes the job that should start now and counts it as running; None if none may start."""
        for priority in sorted(Priority, reverse=True):
            if self._full_for(priority):
                continue
            cls = self._classes[priority]
            picked = _pick(cls.vtime, cls.finish, self._startable_heads(cls))
            if picked is None:
                continue
            entry, start = picked
            tenant = self._tenants[entry.tenant]
            cls.vtime = start
            cls.finish[entry.tenant] = start + 1 / tenant.weight
            self._unqueue(entry)
            tenant.running += 1
            tenant.running_on[entry.model] += 1
            self._running[entry.job_id] = (entry.tenant, entry.model, self.clock())
            self._running_classes[priority] += 1
            self._class_of[entry.job_id] = priority
            self._forget_stale_tags(cls)
            return entry.job_id
        return None

    def finished(self, job_id: str) -> None:
        """Ends a running job (any outcome) and records its duration for retry estimates."""
        if job_id not in self._running:
            raise KeyError(f"job {job_id} is not running")
        tenant, model, started = self._running.pop(job_id)
        _decrement(self._running_classes, self._class_of.pop(job_id))
        self._durations.append(max(0.0, self.clock() - started))
        state = self._tenants[tenant]
        state.running -= 1
        _decrement(state.running_on, model)
        self._forget_tenant_if_idle(tenant)

    def remove(self, job_id: str) -> bool:
        """Drops a queued job (cancelled before it started); False if it is not queued."""
        entry = self._queued.get(job_id)
        if entry is None:
            return False
        self._unqueue(entry)
        self._forget_tenant_if_idle(entry.tenant)
        return True

    # ------------------------------------------------------------ queries --

    def depth(self) -> int:
        """Queued jobs over all tenants."""
        return len(self._queued)

    def running_count(self) -> int:
        return len(self._running)

    def queued_by_model(self) -> Counter[str]:
        """Queued jobs per model (the autoscaling metrics read it at each scrape: O(queued))."""
        return Counter(entry.model for entry in self._queued.values())

    def is_queued(self, job_id: str) -> bool:
        return job_id in self._queued

    def is_running(self, job_id: str) -> bool:
        return job_id in self._running

    def counts(self, tenant: str, model: str | None = None) -> TenantCounts:
        """The tenant's queued and running jobs, or with `model` its jobs on that model."""
        state = self._tenants.get(tenant)
        if state is None:
            return TenantCounts(0, 0)
        if model is not None:
            return TenantCounts(state.queued_on[model], state.running_on[model])
        return TenantCounts(state.queued, state.running)

    def tenants(self) -> dict[str, TenantCounts]:
        """Counts of every tenant that has queued or running jobs."""
        return {name: TenantCounts(state.queued, state.running) for name, state in self._tenants.items()}

    def position(self, job_id: str) -> int | None:
        """0-based estimated start order of a queued job (see `positions`); None if not queued."""
        if job_id not in self._queued:
            return None
        return self.positions()[job_id]

    def positions(self) -> dict[str, int]:
        """Every queued job's estimated place in the start order (0 = next).

        It is the order `next_runnable` would produce from the current state if no
        job arrived or was removed and no running limit held a tenant back:
        higher classes first, and inside a class the fair interleaving of tenants
        by their start tags. Unlike a FIFO position, it can grow: a job that
        arrives later for a tenant with little recent service, or in a higher
        class, may be placed in front. A tenant held at its running limit (its
        own or a model's) starts later than estimated, and others earlier.
        """
        order: dict[str, int] = {}
        for priority in sorted(Priority, reverse=True):
            cls = self._classes[priority]
            vtime, finish = cls.vtime, dict(cls.finish)
            pending = {tenant: deque(_in_admission_order(by_model)) for tenant, by_model in cls.queues.items()}
            while pending:
                picked = _pick(vtime, finish, ((t, q[0]) for t, q in pending.items()))
                assert picked is not None
                entry, start = picked
                vtime = start
                finish[entry.tenant] = start + 1 / self._tenants[entry.tenant].weight
                order[entry.job_id] = len(order)
                queue = pending[entry.tenant]
                queue.popleft()
                if not queue:
                    del pending[entry.tenant]
        return order

    def retry_after(self, tenant: str | None = None, model: str | None = None) -> float:
        """Seconds until a refused admission would likely succeed, from recent job durations.

        For the whole queue: a queued job starts (freeing a place) each time a
        running job ends, about every mean duration / jobs running at once. For
        a tenant (with `model`: its jobs on that model): its first queued job
        must start, which takes its position + 1 such intervals, and at least
        mean duration / a running limit (the tenant's, the model's) that holds
        it back. Clamped to [min_retry_after_s, max_retry_after_s].
        """
        mean = sum(self._durations) / len(self._durations) if self._durations else self.default_job_seconds
        parallel = self.max_running or max(1, len(self._running))
        estimate = mean / parallel
        state = self._tenants.get(tenant) if tenant is not None else None
        if state is not None and (state.queued if model is None else state.queued_on[model]):
            positions = self.positions()
            ahead = min(
                positions[job_id]
                for job_id, entry in self._queued.items()
                if entry.tenant == tenant and (model is None or entry.model == model)
            )
            estimate = mean * (ahead + 1) / parallel
            held = [(state.limits.max_running, state.running)]
            on_model = state.limits.per_model.get(model) if model is not None else None
            if model is not None and on_model is not None:
                held.append((on_model.max_running, state.running_on[model]))
            for limit, running in held:
                if limit is not None and running >= limit:
                    estimate = max(estimate, mean / limit)
        return min(self.max_retry_after_s, max(self.min_retry_after_s, estimate))

    # ----------------------------------------------------------- internals --

    def _startable_heads(self, cls: _Class) -> Iterator[tuple[str, _Entry]]:
        """Each tenant's candidate in the class: its first queued job, in admission order, that may start now
        (the tenant below its running limit, the job's model below the tenant's limit there)."""
        for tenant, by_model in cls.queues.items():
            state = self._tenants[tenant]
            if not state.may_start():
                continue
            heads = (_first(queue) for model, queue in by_model.items() if state.may_start_on(model))
            head = min(heads, key=lambda entry: entry.seq, default=None)
            if head is not None:
                yield tenant, head

    def _unqueue(self, entry: _Entry) -> None:
        del self._queued[entry.job_id]
        queues = self._classes[entry.priority].queues
        by_model = queues[entry.tenant]
        queue = by_model[entry.model]
        del queue[entry.job_id]
        if not queue:
            del by_model[entry.model]
            if not by_model:
                del queues[entry.tenant]
        state = self._tenants[entry.tenant]
        state.queued -= 1
        _decrement(state.queued_on, entry.model)

    def _forget_stale_tags(self, cls: _Class) -> None:
        """Drops finish tags at or below V of tenants with nothing queued: max(V, F) = V for them anyway."""
        stale = [t for t, tag in cls.finish.items() if tag <= cls.vtime and t not in cls.queues]
        for tenant in stale:
            del cls.finish[tenant]

    def _forget_tenant_if_idle(self, tenant: str) -> None:
        state = self._tenants[tenant]
        if state.queued == 0 and state.running == 0:
            del self._tenants[tenant]
