"""Step-level scheduling at the DiT: which running job yields its slot to a waiting one, in which order waiting jobs
take free slots, and how often a running job's denoising state is checkpointed.

A DiT replica runs `step_slots` requests at once and can stop one at a step boundary with its state exported
exactly, to continue it later, there or on another replica. Jobs reaching their DiT stage wait at the orchestrator's
DiT gate for a slot; the runtime holds the gate and asks replicas to yield, and this module decides for it.

Who yields (`choose_victim`). A waiting job may take the slot of a holder only when all of these hold:
- preemption is on (`PreemptionPolicy.enabled`, the cluster's `--preemption`);
- the holder is of a strictly lower priority class than the waiter: a job never yields to its own class;
- the holder is `preemptible`: its tenant allows it (`preemptible` in the tenants file), its request has neither a
  step cache nor adapters (their state is not exported), and its replica can yield;
- it has yielded fewer than `max_preemptions` times, so that no job is starved by being put back again and again;
- it has more than `protect_last_steps` steps left: a job about to finish frees its slot soon anyway;
- it is not already asked to yield (`yielding`), so that one waiter never takes two slots.
Among the candidates the victim is, in this order: of the lowest class; with the fewest steps done (its state is
kept exactly, so a yield costs it only the wait, and the job furthest from its end loses least by waiting); of the
tenant with the most running jobs per unit of weight (the tenant most over its fair
share gives way first); admitted last (largest `seq`). Each rule decides only ties of the ones before it, and the
last one has none, so the choice is deterministic.

Which waiter goes first (`gate_order`): the higher priority class; inside a class the least slack, where slack is
the deadline minus now minus the estimated remaining work (step_times.py), so the job that most needs its slot gets
it; jobs without a deadline come after every job with one (their slack is infinite); then admission order. A job
that was preempted waits with its original `seq`: it returns to the queue at its place, not at its end.

Checkpoints (`CheckpointPolicy`): with `every` K > 0, a running job's denoising state is saved every K steps, so
that a replica's failure loses at most K steps; jobs with fewer than `min_steps` steps are not checkpointed, as
computing them again costs less than saving their state.

Pure decisions: no asyncio, no clock but the `now` a caller passes; the fair-share comparison is made on exact
fractions. Each call costs O(n log n) in the jobs it is given.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

DEFAULT_MAX_PREEMPTIONS = 2
DEFAULT_PROTECT_LAST_STEPS = 3
DEFAULT_CHECKPOINT_EVERY = 0
DEFAULT_CHECKPOINT_MIN_STEPS = 20


def _check_count(name: str, value: object, least: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: {value!r}; must be an integer of at least {least}{meaning}")


@dataclass(frozen=True)
class PreemptionPolicy:
    """The cluster's preemption knobs (`--preemption`, `--max-preemptions`, `--preemption-protect-steps`).

    `max_preemptions` is per job (0: no job is ever preempted); a job with at most `protect_last_steps` steps left
    is never preempted.
    """

    enabled: bool = True
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    protect_last_steps: int = DEFAULT_PROTECT_LAST_STEPS

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled: {self.enabled!r}; must be True or False")
        _check_count("max_preemptions", self.max_preemptions, 0, " (0: never preempt)")
        _check_count("protect_last_steps", self.protect_last_steps, 0, " (0: protect no step)")


@dataclass(frozen=True)
class CheckpointPolicy:
    """How often a running job's denoising state is saved for a handoff on failure (`--checkpoint-every`,
    `--checkpoint-min-steps`): every `every` steps (0: never), for jobs of at least `min_steps` steps."""

    every: int = DEFAULT_CHECKPOINT_EVERY
    min_steps: int = DEFAULT_CHECKPOINT_MIN_STEPS

    def __post_init__(self) -> None:
        _check_count("every", self.every, 0, " (0: no checkpoints)")
        _check_count("min_steps", self.min_steps, 0, "")

    def every_for(self, steps: int) -> int:
        """The checkpoint interval of a job of `steps` denoising steps: `every`, or 0 (none) below `min_steps`."""
        return self.every if steps >= self.min_steps else 0


@dataclass(frozen=True)
class Holder:
    """A job holding a DiT slot, at step `step` of `total` (steps done), after `preemptions` yields so far.

    `priority` is its class (higher first, as scheduler.Priority); `weight` its tenant's weight; `seq` its
    admission order; `preemptible` is False when its tenant turned preemption off, its request has a step cache or
    adapters, or its replica cannot yield.
    """

    job_id: str
    tenant: str
    priority: int
    step: int
    total: int
    preemptions: int = 0
    preemptible: bool = True
    weight: float = 1.0
    seq: int = 0

    def __post_init__(self) -> None:
        _check_count("total", self.total, 1, "")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step <= self.total:
            raise ValueError(f"step: {self.step!r}; must be an integer from 0 to total ({self.total})")
        _check_count("preemptions", self.preemptions, 0, "")
        if isinstance(self.weight, bool) or not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight: {self.weight!r}; must be a finite number above 0")

    @property
    def steps_left(self) -> int:
        return self.total - self.step


@dataclass(frozen=True)
class Waiter:
    """A job waiting at the DiT gate: its class (higher first), admission order, and optionally its deadline and
    the estimated seconds of work it has left (both on the clock of the `now` given to `gate_order`)."""

    job_id: str
    tenant: str
    priority: int
    seq: int
    deadline: float | None = None
    estimate_s: float | None = None

    def slack(self, now: float) -> float:
        """Seconds to spare: deadline - now - estimated work (none known: 0); infinite without a deadline."""
        if self.deadline is None:
            return math.inf
        return self.deadline - now - (self.estimate_s or 0.0)


def may_preempt(waiter: Waiter, holder: Holder, policy: PreemptionPolicy, yielding: Collection[str] = ()) -> bool:
    """Whether `holder` may yield its slot to `waiter` (the module's rules, besides the order among candidates)."""
    return (
        policy.enabled
        and holder.preemptible
        and holder.priority < waiter.priority
        and holder.preemptions < policy.max_preemptions
        and holder.steps_left > policy.protect_last_steps
        and holder.job_id not in yielding
    )


def choose_victim(
    waiter: Waiter,
    holders: Iterable[Holder],
    policy: PreemptionPolicy,
    running_per_tenant: Mapping[str, int],
    yielding: Collection[str] = (),
) -> Holder | None:
    """The holder that should yield its slot to `waiter`, or None when preemption is off or none may.

    `running_per_tenant` counts each tenant's running jobs (a tenant absent from it: 0) for the fair-share rule;
    `yielding` holds the ids of the jobs already asked to yield. The order is the module docstring's.
    """
    candidates = [holder for holder in holders if may_preempt(waiter, holder, policy, yielding)]
    if not candidates:
        return None

    def order(holder: Holder) -> tuple[int, int, Fraction, int]:
        share = Fraction(running_per_tenant.get(holder.tenant, 0)) / Fraction(holder.weight)
        return (holder.priority, holder.step, -share, -holder.seq)

    return min(candidates, key=order)


def gate_order(waiters: Iterable[Waiter], now: float) -> list[Waiter]:
    """The waiters in the order they take free DiT slots: higher class first, then least slack (no deadline:
    last), then admission `seq`."""

    def order(waiter: Waiter) -> tuple[int, bool, float, int]:
        slack = waiter.slack(now)
        return (-waiter.priority, waiter.deadline is None, slack if waiter.deadline is not None else 0.0, waiter.seq)

    return sorted(waiters, key=order)
