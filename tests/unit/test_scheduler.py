"""The job scheduler: strict priority, weighted fair sharing, admission limits (per tenant and per model), positions,
retry estimates."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.orchestrator.admission import queue_limits
from services.orchestrator.scheduler import (
    PRIORITY_NAMES,
    AdmissionRefused,
    FairScheduler,
    JobLimits,
    Priority,
    TenantCounts,
    TenantLimits,
)
from services.orchestrator.tenants import Quotas, Tenant


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drain(scheduler: FairScheduler) -> list[str]:
    """Starts and at once finishes jobs until none is left: the pure start order."""
    order = []
    while (job_id := scheduler.next_runnable()) is not None:
        order.append(job_id)
        scheduler.finished(job_id)
    return order


def test_priority_names_and_parsing() -> None:
    assert PRIORITY_NAMES == ("high", "normal", "low")
    assert Priority.parse("HIGH") is Priority.HIGH and Priority.parse(0) is Priority.LOW
    assert Priority.HIGH > Priority.NORMAL > Priority.LOW
    with pytest.raises(ValueError, match="urgent.*high, normal, low"):
        Priority.parse("urgent")
    with pytest.raises(ValueError, match="7"):
        Priority.parse(7)


def test_single_tenant_is_fifo() -> None:
    scheduler = FairScheduler()
    for i in range(5):
        scheduler.admit(f"j{i}", "acme")
    assert scheduler.positions() == {f"j{i}": i for i in range(5)}
    assert drain(scheduler) == [f"j{i}" for i in range(5)]


def test_a_tenants_jobs_on_several_models_are_fifo() -> None:
    scheduler = FairScheduler()
    limits = TenantLimits(per_model={"A": JobLimits(max_running=2)})  # never reached: one job runs at a time
    for i, model in enumerate("ABBAB"):
        scheduler.admit(f"j{i}", "acme", limits=limits, model=model)
    assert scheduler.positions() == {f"j{i}": i for i in range(5)}
    assert drain(scheduler) == [f"j{i}" for i in range(5)]


def test_higher_class_always_goes_first() -> None:
    scheduler = FairScheduler()
    scheduler.admit("low", "a", "low")
    scheduler.admit("normal", "b", "normal")
    scheduler.admit("high", "c", "high")
    assert scheduler.position("high") == 0 and scheduler.position("low") == 2
    assert drain(scheduler) == ["high", "normal", "low"]


@pytest.mark.parametrize("from_the_top", [False, True])
def test_max_running_from_the_top_lets_a_higher_class_start_past_lower_ones(from_the_top: bool) -> None:
    """With preemption on, lower classes holding every running slot (waiting for a DiT) never keep a higher class
    from starting; at most max_running jobs of each class and above run."""
    scheduler = FairScheduler(max_running=2, max_running_from_the_top=from_the_top)
    for name in ("low1", "low2", "low3"):
        scheduler.admit(name, "a", "low")
    assert [scheduler.next_runnable(), scheduler.next_runnable(), scheduler.next_runnable()] == ["low1", "low2", None]
    for name in ("normal1", "normal2", "normal3", "high1", "high2"):
        scheduler.admit(name, "b", name.rstrip("123"))
    started = []
    while (job_id := scheduler.next_runnable()) is not None:
        started.append(job_id)
    if not from_the_top:
        assert started == [] and scheduler.running_count() == 2
        return
    # Two high ones (the limit for high), then nothing more: high and normal together are at the limit too.
    assert started == ["high1", "high2"]
    scheduler.finished("high1")
    assert scheduler.next_runnable() == "normal1" and scheduler.next_runnable() is None
    scheduler.finished("low1")  # a low slot frees: the normal jobs are still at the limit with the high one
    assert scheduler.next_runnable() is None
    scheduler.finished("high2")
    assert scheduler.next_runnable() == "normal2" and scheduler.running_count() == 3


def test_weights_share_slots_in_proportion() -> None:
    scheduler = FairScheduler(max_queued=None)
    for i in range(30):
        scheduler.admit(f"a{i}", "a", weight=2)
        scheduler.admit(f"b{i}", "b", weight=1)
    first = drain(scheduler)[:30]
    assert Counter(job[0] for job in first) == {"a": 20, "b": 10}


def test_idle_tenant_gets_no_burst_of_credit() -> None:
    scheduler = FairScheduler(max_queued=None)
    for i in range(50):
        scheduler.admit(f"a{i}", "a")
    for _ in range(40):  # a runs alone for a while; b is idle
        scheduler.finished(scheduler.next_runnable())
    for i in range(10):
        scheduler.admit(f"b{i}", "b")
    tenants = [job[0] for job in drain(scheduler)[:20]]
    # b gets its fair half from now on, alternating with a, not ten jobs in a row.
    assert tenants == ["b", "a"] * 10


def test_tenant_at_running_limit_is_skipped_not_blocking() -> None:
    scheduler = FairScheduler()
    limits = TenantLimits(max_running=1)
    scheduler.admit("a1", "a", "high", limits=limits)
    scheduler.admit("a2", "a", "high", limits=limits)
    scheduler.admit("b1", "b", "low")
    assert scheduler.next_runnable() == "a1"
    # a2 is higher priority but a is at its limit: b1 goes instead of nothing.
    assert scheduler.next_runnable() == "b1"
    assert scheduler.next_runnable() is None
    assert scheduler.counts("a") == TenantCounts(queued=1, running=1)
    scheduler.finished("a1")
    assert scheduler.next_runnable() == "a2"


def test_a_tenant_at_its_running_limit_on_one_model_starts_its_jobs_on_another() -> None:
    scheduler = FairScheduler()
    limits = TenantLimits(per_model={"A": JobLimits(max_running=1)})
    scheduler.admit("a1", "acme", limits=limits, model="A")
    scheduler.admit("a2", "acme", limits=limits, model="A")
    scheduler.admit("b1", "acme", limits=limits, model="B")
    assert scheduler.next_runnable() == "a1"
    # a2 is first in line, but acme runs its one job on A already: its job on B starts instead of nothing.
    assert scheduler.next_runnable() == "b1"
    assert scheduler.next_runnable() is None
    assert scheduler.counts("acme", "A") == TenantCounts(queued=1, running=1)
    assert scheduler.counts("acme", "B") == TenantCounts(queued=0, running=1)
    assert scheduler.counts("acme") == TenantCounts(queued=1, running=2)
    scheduler.finished("b1")
    assert scheduler.next_runnable() is None  # a job ending on B frees nothing on A
    scheduler.finished("a1")
    assert scheduler.next_runnable() == "a2"


def test_a_model_limit_changes_which_of_a_tenants_jobs_starts_never_its_share() -> None:
    scheduler = FairScheduler()
    limits = TenantLimits(per_model={"A": JobLimits(max_running=1)})
    for job_id, model in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")):
        scheduler.admit(job_id, "x", limits=limits, model=model)
    for i in range(1, 4):
        scheduler.admit(f"y{i}", "y", model="A")  # y has no limit on A
    # x and y alternate: x's jobs on B take the turns its held job on A cannot, and y's turns are its own.
    order = [scheduler.next_runnable() for _ in range(7)]
    assert order == ["a1", "y1", "b1", "y2", "b2", "y3", None]
    scheduler.finished("a1")
    assert scheduler.next_runnable() == "a2"


def test_a_full_share_on_one_model_refuses_that_models_jobs_only() -> None:
    clock = FakeClock()
    scheduler = FairScheduler(clock=clock, default_job_seconds=30.0)
    limits = TenantLimits(max_queued=10, per_model={"A": JobLimits(max_queued=2)})
    scheduler.admit("a1", "acme", limits=limits, model="A")
    scheduler.admit("a2", "acme", limits=limits, model="A")
    with pytest.raises(AdmissionRefused) as refused:
        scheduler.admit("a3", "acme", limits=limits, model="A")
    assert refused.value.scope == "model" and refused.value.model == "A" and refused.value.tenant == "acme"
    assert "tenant 'acme' has 2 queued jobs on model 'A'" in str(refused.value)
    assert refused.value.retry_after_s == pytest.approx(30.0)  # a1 at position 0, one slot (none running)
    assert scheduler.counts("acme", "A") == TenantCounts(queued=2, running=0)
    # The tenant's other models, its jobs without a model and other tenants' jobs on A are still admitted.
    scheduler.admit("b1", "acme", limits=limits, model="B")
    scheduler.admit("none", "acme", limits=limits)
    scheduler.admit("other", "beta", model="A")
    assert scheduler.next_runnable() == "a1"  # a place on A is free again once a1 starts
    scheduler.admit("a3", "acme", limits=limits, model="A")
    # Recovery re-admits regardless of the model's limit.
    scheduler.admit("r1", "acme", limits=limits, model="A", check_limits=False)
    assert scheduler.counts("acme", "A") == TenantCounts(queued=3, running=1)


def test_per_model_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_running"):
        JobLimits(max_running=0)
    with pytest.raises(ValueError, match="per_model"):
        TenantLimits(per_model={"": JobLimits(max_running=1)})


def test_queue_limits_are_the_tenants_quotas_and_its_model_quotas() -> None:
    tenant = Tenant(
        name="acme",
        quotas=Quotas(max_running_jobs=4, max_queued_jobs=8),
        model_quotas={"A": Quotas(max_running_jobs=1), "B": Quotas(max_height=64), "C": Quotas(max_queued_jobs=2)},
    )
    # B sets no job limit: it has none of its own (the tenant's hold for all its jobs).
    expected = TenantLimits(
        max_queued=8,
        max_running=4,
        per_model={"A": JobLimits(max_running=1), "C": JobLimits(max_queued=2)},
    )
    assert queue_limits(tenant) == expected
    assert queue_limits(Tenant(name="solo")) == TenantLimits()
    assert queue_limits(None) == TenantLimits()


def test_global_running_limit() -> None:
    scheduler = FairScheduler(max_running=2)
    for i in range(3):
        scheduler.admit(f"j{i}", "t")
    assert [scheduler.next_runnable(), scheduler.next_runnable(), scheduler.next_runnable()] == ["j0", "j1", None]
    scheduler.finished("j0")
    assert scheduler.next_runnable() == "j2"
    assert scheduler.running_count() == 2


def test_remove_and_counts() -> None:
    scheduler = FairScheduler()
    scheduler.admit("x", "a")
    scheduler.admit("y", "a")
    scheduler.admit("z", "b")
    assert scheduler.depth() == 3
    assert scheduler.remove("x") is True
    assert scheduler.remove("x") is False and scheduler.remove("unknown") is False
    assert scheduler.tenants() == {"a": TenantCounts(1, 0), "b": TenantCounts(1, 0)}
    started = scheduler.next_runnable()
    assert scheduler.remove(started) is False  # running jobs are cancelled by the caller, then finished
    assert scheduler.position(started) is None
    scheduler.finished(started)
    with pytest.raises(KeyError):
        scheduler.finished(started)
    assert scheduler.depth() == 1


def test_bad_arguments_are_refused() -> None:
    scheduler = FairScheduler()
    scheduler.admit("x", "a")
    with pytest.raises(ValueError, match="already admitted"):
        scheduler.admit("x", "a")
    for weight in (0, -1, math.inf, math.nan, 1e7, 1e-9, True, "2"):
        with pytest.raises(ValueError, match="weight"):
            scheduler.admit("y", "a", weight=weight)
    with pytest.raises(ValueError, match="max_running"):
        TenantLimits(max_running=0)
    assert scheduler.depth() == 1


def test_admission_limits_and_retry_after() -> None:
    clock = FakeClock()
    scheduler = FairScheduler(max_queued=4, max_running=2, clock=clock, default_job_seconds=30.0)
    limits = TenantLimits(max_queued=2)
    scheduler.admit("a1", "a", limits=limits)
    scheduler.admit("a2", "a", limits=limits)
    with pytest.raises(AdmissionRefused) as refused:
        scheduler.admit("a3", "a", limits=limits)
    assert refused.value.scope == "tenant" and refused.value.tenant == "a"
    # No job has finished yet: the default duration, first queued job at position 0, two slots.
    assert refused.value.retry_after_s == pytest.approx(30.0 / 2)
    scheduler.admit("b1", "b")
    scheduler.admit("b2", "b")
    with pytest.raises(AdmissionRefused) as refused:
        scheduler.admit("c1", "c")
    assert refused.value.scope == "global"
    assert scheduler.tenants().keys() == {"a", "b"}  # a refused tenant leaves no trace

    # Jobs of 10 s: a queue place frees every 10 s / 2 running jobs.
    for _ in range(2):
        job_id = scheduler.next_runnable()
        clock.now += 10.0
        scheduler.finished(job_id)
    assert scheduler.retry_after() == pytest.approx(5.0)
    # Recovery re-admits regardless of limits.
    assert scheduler.counts("a").queued == 1
    for i in range(3):
        scheduler.admit(f"r{i}", "a", limits=limits, check_limits=False)
    assert scheduler.counts("a").queued == 4


def test_retry_after_for_tenant_counts_the_jobs_ahead_and_clamps() -> None:
    clock = FakeClock()
    scheduler = FairScheduler(max_running=1, clock=clock, default_job_seconds=4.0, max_retry_after_s=100.0)
    scheduler.admit("b1", "b", "high")
    scheduler.admit("b2", "b", "high")
    scheduler.admit("a1", "a", "low")
    assert scheduler.retry_after("a") == pytest.approx(4.0 * 3)  # two high jobs ahead, then a1
    scheduler.default_job_seconds = 1000.0
    assert scheduler.retry_after("a") == 100.0
    scheduler.default_job_seconds = 0.01
    assert scheduler.retry_after() == 1.0


def test_positions_match_the_start_order() -> None:
    scheduler = FairScheduler()
    for i in range(4):
        scheduler.admit(f"a{i}", "a", "normal", weight=3)
        scheduler.admit(f"b{i}", "b", "normal")
        scheduler.admit(f"c{i}", "c", "high" if i % 2 else "low")
    positions = scheduler.positions()
    order = drain(scheduler)
    assert sorted(positions, key=positions.get) == order


# --------------------------------------------------------------- properties --

weights = st.integers(min_value=1, max_value=8) | st.sampled_from([0.5, 0.25, 1.5])


@settings(max_examples=60, deadline=None)
@given(st.lists(weights, min_size=2, max_size=5), st.integers(min_value=1, max_value=200))
def test_backlogged_tenants_get_slots_in_proportion_to_weight(tenant_weights: list[float], dispatches: int) -> None:
    scheduler = FairScheduler(max_queued=None)
    for tenant, weight in enumerate(tenant_weights):
        for i in range(dispatches):
            scheduler.admit(f"{tenant}.{i}", str(tenant), weight=weight)
    counts = Counter()
    for _ in range(dispatches):
        job_id = scheduler.next_runnable()
        scheduler.finished(job_id)
        counts[int(job_id.split(".")[0])] += 1
        # At every prefix, normalised service differs by at most max(1/w_i, 1/w_j).
        for i, w_i in enumerate(tenant_weights):
            for j, w_j in enumerate(tenant_weights):
                assert abs(counts[i] / w_i - counts[j] / w_j) <= max(1 / w_i, 1 / w_j) + 1e-9
    # In the long run, shares approach the weight fractions.
    total = sum(tenant_weights)
    for i, w_i in enumerate(tenant_weights):
        assert abs(counts[i] - dispatches * w_i / total) <= len(tenant_weights) + 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=4), min_size=2, max_size=4),
    st.lists(st.tuples(st.integers(min_value=0, max_value=3), st.booleans()), max_size=150),
)
def test_no_starvation_inside_a_class(tenant_weights: list[int], ops: list[tuple[int, bool]]) -> None:
    """While a tenant waits, each other tenant j starts at most ceil(w_j / w_x) + 1 jobs before it."""
    scheduler = FairScheduler(max_queued=None)
    queued = Counter()
    overtaken: dict[int, Counter] = {}  # waiting tenant -> starts of others since it started waiting
    for n, (tenant, dispatch) in enumerate(ops):
        tenant %= len(tenant_weights)
        if not dispatch:
            scheduler.admit(f"{tenant}.{n}", str(tenant), weight=tenant_weights[tenant])
            queued[tenant] += 1
            overtaken.setdefault(tenant, Counter())
            continue
        job_id = scheduler.next_runnable()
        if job_id is None:
            assert sum(queued.values()) == 0
            continue
        scheduler.finished(job_id)
        started = int(job_id.split(".")[0])
        queued[started] -= 1
        overtaken[started] = Counter()
        if queued[started] == 0:
            del overtaken[started]
        for waiting, others in overtaken.items():
            if waiting != started:
                others[started] += 1
                bound = math.ceil(tenant_weights[started] / tenant_weights[waiting]) + 1
                assert others[started] <= bound


class SchedulerMachine(RuleBasedStateMachine):
    """Random admissions, starts, finishes and removals against a simple model of the rules."""

    @initialize(
        max_queued=st.none() | st.integers(min_value=1, max_value=12),
        max_running=st.none() | st.integers(min_value=1, max_value=4),
        tenant_limits=st.lists(
            st.tuples(
                st.none() | st.integers(min_value=1, max_value=5),
                st.none() | st.integers(min_value=1, max_value=3),
                st.integers(min_value=1, max_value=5),
                # Its limits on model "m0" (queued, running); "m1" and "" have none.
                st.none() | st.integers(min_value=1, max_value=3),
                st.none() | st.integers(min_value=1, max_value=2),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def setup(self, max_queued, max_running, tenant_limits) -> None:
        self.scheduler = FairScheduler(max_queued=max_queued, max_running=max_running)
        self.limits = [TenantLimits(q, r, per_model={"m0": JobLimits(mq, mr)}) for q, r, _, mq, mr in tenant_limits]
        self.weights = [w for _, _, w, _, _ in tenant_limits]
        self.queued: dict[str, tuple[int, Priority, str]] = {}
        self.running: dict[str, tuple[int, str]] = {}
        self.admitted: set[str] = set()
        self.removed: set[str] = set()
        self.started: list[str] = []
        self.counter = 0

    def _model_limit(self, tenant: int, model: str) -> JobLimits:
        return self.limits[tenant].per_model.get(model, JobLimits())

    @rule(
        tenant=st.integers(min_value=0, max_value=3),
        priority=st.sampled_from(list(Priority)),
        model=st.sampled_from(["", "m0", "m1"]),
    )
    def admit(self, tenant: int, priority: Priority, model: str) -> None:
        tenant %= len(self.limits)
        job_id = f"j{self.counter}"
        self.counter += 1
        full = self.scheduler.max_queued is not None and len(self.queued) >= self.scheduler.max_queued
        mine = sum(1 for t, _, _ in self.queued.values() if t == tenant)
        limit = self.limits[tenant].max_queued
        mine_on = sum(1 for t, _, m in self.queued.values() if t == tenant and m == model)
        limit_on = self._model_limit(tenant, model).max_queued
        over = full or (limit is not None and mine >= limit) or (limit_on is not None and mine_on >= limit_on)
        try:
            self.scheduler.admit(job_id, f"t{tenant}", priority, self.weights[tenant], self.limits[tenant], model=model)
        except AdmissionRefused as refused:
            assert over
            assert refused.retry_after_s >= self.scheduler.min_retry_after_s
            return
        assert not over
        self.queued[job_id] = (tenant, priority, model)
        self.admitted.add(job_id)

    def _eligible(self) -> list[tuple[str, int, Priority]]:
        if self.scheduler.max_running is not None and len(self.running) >= self.scheduler.max_running:
            return []
        busy = Counter(tenant for tenant, _ in self.running.values())
        busy_on = Counter(self.running.values())
        eligible = []
        for job_id, (tenant, priority, model) in self.queued.items():
            limit = self.limits[tenant].max_running
            limit_on = self._model_limit(tenant, model).max_running
            if (limit is None or busy[tenant] < limit) and (limit_on is None or busy_on[tenant, model] < limit_on):
                eligible.append((job_id, tenant, priority))
        return eligible

    @rule()
    def start(self) -> None:
        eligible = self._eligible()
        job_id = self.scheduler.next_runnable()
        if job_id is None:
            assert not eligible  # work-conserving: nothing startable is held back
            return
        tenant, priority, model = self.queued.pop(job_id)
        assert job_id in {e[0] for e in eligible}
        assert all(p <= priority for _, _, p in eligible)  # strict priority
        self.running[job_id] = (tenant, model)
        self.started.append(job_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[job_id]
        self.scheduler.finished(job_id)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def remove(self, data) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.queued)))
        assert self.scheduler.remove(job_id)
        del self.queued[job_id]
        self.removed.add(job_id)

    @invariant()
    def limits_hold_and_counts_agree(self) -> None:
        scheduler = self.scheduler
        assert scheduler.depth() == len(self.queued)
        assert scheduler.running_count() == len(self.running)
        if scheduler.max_running is not None:
            assert len(self.running) <= scheduler.max_running
        if scheduler.max_queued is not None:
            assert len(self.queued) <= scheduler.max_queued
        for tenant, limits in enumerate(self.limits):
            counts = scheduler.counts(f"t{tenant}")
            assert counts.queued == sum(1 for t, _, _ in self.queued.values() if t == tenant)
            assert counts.running == sum(1 for t, _ in self.running.values() if t == tenant)
            assert limits.max_running is None or counts.running <= limits.max_running
            assert limits.max_queued is None or counts.queued <= limits.max_queued
            for model in ("", "m0", "m1"):
                on_model = scheduler.counts(f"t{tenant}", model)
                assert on_model.queued == sum(1 for t, _, m in self.queued.values() if (t, m) == (tenant, model))
                assert on_model.running == sum(1 for job in self.running.values() if job == (tenant, model))
                model_limits = self._model_limit(tenant, model)
                assert model_limits.max_running is None or on_model.running <= model_limits.max_running
                assert model_limits.max_queued is None or on_model.queued <= model_limits.max_queued
        assert sorted(scheduler.positions().values()) == list(range(len(self.queued)))

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        # Finish everything: every admitted job starts exactly once unless removed.
        for job_id in list(self.running):
            self.scheduler.finished(job_id)
        self.running.clear()
        while (job_id := self.scheduler.next_runnable()) is not None:
            self.started.append(job_id)
            self.scheduler.finished(job_id)
        assert len(self.started) == len(set(self.started))
        assert set(self.started) == self.admitted - self.removed
        assert self.scheduler.depth() == 0 and self.scheduler.tenants() == {}


SchedulerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
