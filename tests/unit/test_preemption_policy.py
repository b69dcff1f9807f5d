"""Who yields a DiT slot to a waiting job, the bounds on it, and the order waiting jobs take free slots."""

from __future__ import annotations

import math

import pytest

from services.orchestrator.preemption import (
    CheckpointPolicy,
    Holder,
    PreemptionPolicy,
    Waiter,
    choose_victim,
    gate_order,
    may_preempt,
)
from services.orchestrator.scheduler import Priority

HIGH, NORMAL, LOW = int(Priority.HIGH), int(Priority.NORMAL), int(Priority.LOW)
POLICY = PreemptionPolicy()


def holder(
    job_id: str,
    priority: int = LOW,
    step: int = 5,
    total: int = 30,
    *,
    tenant: str = "t",
    preemptions: int = 0,
    preemptible: bool = True,
    weight: float = 1.0,
    seq: int = 0,
) -> Holder:
    return Holder(job_id, tenant, priority, step, total, preemptions, preemptible, weight, seq)


def waiter(
    job_id: str = "w",
    priority: int = HIGH,
    seq: int = 100,
    *,
    deadline: float | None = None,
    estimate_s: float | None = None,
) -> Waiter:
    return Waiter(job_id, "waiting", priority, seq, deadline, estimate_s)


def victim(
    holders: list[Holder],
    *,
    policy: PreemptionPolicy = POLICY,
    running: dict[str, int] | None = None,
    yielding: frozenset[str] = frozenset(),
    of: Waiter | None = None,
) -> str | None:
    chosen = choose_victim(of or waiter(), holders, policy, running or {}, yielding)
    return None if chosen is None else chosen.job_id


# ------------------------------------------------------------------------------------------------- who yields --


def test_the_lowest_class_yields_first_whatever_its_progress() -> None:
    holders = [holder("normal", NORMAL, step=0), holder("low", LOW, step=20)]
    assert victim(holders) == "low"


def test_within_a_class_the_job_with_fewest_steps_done_yields() -> None:
    holders = [holder("late", step=12), holder("early", step=2), holder("middle", step=7)]
    assert victim(holders) == "early"


def test_with_equal_progress_the_tenant_most_over_its_share_yields() -> None:
    holders = [
        holder("a1", step=4, tenant="a", weight=2.0, seq=1),  # 4 running / weight 2 = 2 per unit
        holder("b1", step=4, tenant="b", weight=1.0, seq=2),  # 3 running / weight 1 = 3 per unit
        holder("c1", step=4, tenant="c", weight=0.5, seq=3),  # 1 running / weight 0.5 = 2 per unit
    ]
    assert victim(holders, running={"a": 4, "b": 3, "c": 1}) == "b1"
    # With b's weight raised to 3 it is at 1 per unit: a and c tie at 2, and the later admitted of them yields.
    holders[1] = holder("b1", step=4, tenant="b", weight=3.0, seq=2)
    assert victim(holders, running={"a": 4, "b": 3, "c": 1}) == "c1"


def test_a_tenant_absent_from_the_running_counts_counts_as_none_running() -> None:
    holders = [holder("x", tenant="x", seq=9), holder("y", tenant="y", seq=1)]
    assert victim(holders, running={"y": 1}) == "y"


def test_the_last_tie_breaker_is_the_latest_admitted() -> None:
    holders = [holder("first", seq=1), holder("third", seq=3), holder("second", seq=2)]
    assert victim(holders) == "third"


def test_a_waiter_never_preempts_its_own_class_or_a_higher_one() -> None:
    holders = [holder("same", NORMAL), holder("higher", HIGH)]
    assert victim(holders, of=waiter(priority=NORMAL)) is None
    assert victim(holders, of=waiter(priority=LOW)) is None
    assert victim(holders, of=waiter(priority=HIGH)) == "same"


# ------------------------------------------------------------------------------------------------- the bounds --


def test_a_job_preempted_max_times_is_not_preempted_again() -> None:
    policy = PreemptionPolicy(max_preemptions=2)
    assert victim([holder("j", preemptions=1)], policy=policy) == "j"
    assert victim([holder("j", preemptions=2)], policy=policy) is None
    assert victim([holder("j", preemptions=0)], policy=PreemptionPolicy(max_preemptions=0)) is None
    # The bound picks among candidates: the least advanced job at its bound is passed over for the next.
    holders = [holder("spent", step=1, preemptions=2), holder("next", step=9, preemptions=1)]
    assert victim(holders, policy=policy) == "next"


def test_a_job_within_its_protected_last_steps_is_never_preempted() -> None:
    policy = PreemptionPolicy(protect_last_steps=3)
    assert victim([holder("j", step=27, total=30)], policy=policy) is None  # 3 left
    assert victim([holder("j", step=26, total=30)], policy=policy) == "j"  # 4 left
    assert victim([holder("j", step=30, total=30)], policy=PreemptionPolicy(protect_last_steps=0)) is None
    assert victim([holder("j", step=29, total=30)], policy=PreemptionPolicy(protect_last_steps=0)) == "j"


def test_a_job_already_asked_to_yield_is_not_chosen_again() -> None:
    holders = [holder("asked", step=1), holder("other", step=10)]
    assert victim(holders, yielding=frozenset({"asked"})) == "other"
    assert victim(holders, yielding=frozenset({"asked", "other"})) is None


def test_a_job_that_is_not_preemptible_is_passed_over() -> None:
    # Its tenant turned preemption off, or its request has a step cache or adapters, or its replica cannot yield.
    holders = [holder("kept", step=1, preemptible=False), holder("taken", step=10)]
    assert victim(holders) == "taken"
    assert victim([holders[0]]) is None


def test_preemption_off_for_the_cluster_preempts_nothing() -> None:
    holders = [holder("j", step=1)]
    assert victim(holders, policy=PreemptionPolicy(enabled=False)) is None
    assert not may_preempt(waiter(), holders[0], PreemptionPolicy(enabled=False))
    assert may_preempt(waiter(), holders[0], POLICY)


def test_no_holders_no_victim() -> None:
    assert victim([]) is None


# ---------------------------------------------------------------------------------------------- knob checking --


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_preemptions": -1}, "max_preemptions"),
        ({"protect_last_steps": -1}, "protect_last_steps"),
        ({"max_preemptions": 1.5}, "max_preemptions"),
        ({"max_preemptions": True}, "max_preemptions"),
        ({"enabled": "yes"}, "enabled"),
    ],
)
def test_a_policy_out_of_bounds_is_refused_naming_its_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}: "):
        PreemptionPolicy(**fields)  # type: ignore[arg-type]


def test_policy_defaults() -> None:
    assert PreemptionPolicy() == PreemptionPolicy(enabled=True, max_preemptions=2, protect_last_steps=3)
    assert CheckpointPolicy() == CheckpointPolicy(every=0, min_steps=20)


def test_holders_out_of_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="^step: "):
        holder("j", step=31, total=30)
    with pytest.raises(ValueError, match="^total: "):
        holder("j", step=0, total=0)
    with pytest.raises(ValueError, match="^weight: "):
        holder("j", weight=math.nan)
    assert holder("j", step=26, total=30).steps_left == 4


def test_checkpoint_interval_is_off_below_min_steps() -> None:
    policy = CheckpointPolicy(every=5, min_steps=20)
    assert [policy.every_for(steps) for steps in (1, 19, 20, 50)] == [0, 0, 5, 5]
    assert CheckpointPolicy(every=0, min_steps=0).every_for(50) == 0
    assert CheckpointPolicy(every=4, min_steps=0).every_for(1) == 4
    with pytest.raises(ValueError, match="^every: "):
        CheckpointPolicy(every=-1)
    with pytest.raises(ValueError, match="^min_steps: "):
        CheckpointPolicy(min_steps=-1)


# -------------------------------------------------------------------------------------------------- gate order --


def order(waiters: list[Waiter], now: float = 1000.0) -> list[str]:
    return [w.job_id for w in gate_order(waiters, now)]


def test_without_deadlines_the_gate_takes_class_then_admission_order() -> None:
    waiters = [
        waiter("n2", NORMAL, seq=2),
        waiter("l1", LOW, seq=1),
        waiter("h3", HIGH, seq=3),
        waiter("n1", NORMAL, seq=0),
    ]
    assert order(waiters) == ["h3", "n1", "n2", "l1"]


def test_within_a_class_the_least_slack_goes_first_and_no_deadline_goes_last() -> None:
    now = 1000.0
    waiters = [
        waiter("none", NORMAL, seq=0),
        waiter("roomy", NORMAL, seq=1, deadline=now + 100, estimate_s=10),  # slack 90
        waiter("tight", NORMAL, seq=2, deadline=now + 50, estimate_s=40),  # slack 10
        waiter("late", NORMAL, seq=3, deadline=now + 20, estimate_s=30),  # slack -10
        waiter("unknown", NORMAL, seq=4, deadline=now + 60),  # no estimate: slack 60
        waiter("low", LOW, seq=5, deadline=now + 1, estimate_s=100),  # lower class, despite its slack
    ]
    assert order(waiters, now) == ["late", "tight", "unknown", "roomy", "none", "low"]
    assert waiters[2].slack(now) == 10.0
    assert waiters[0].slack(now) == math.inf


def test_equal_slack_goes_by_admission_and_a_preempted_job_keeps_its_place() -> None:
    now = 0.0
    # "back" was admitted first, preempted, and waits again with its original seq: it goes before the later one.
    waiters = [
        waiter("later", seq=7, deadline=50.0, estimate_s=10.0),
        waiter("back", seq=3, deadline=45.0, estimate_s=5.0),
    ]
    assert order(waiters, now) == ["back", "later"]
    waiters = [waiter("later", seq=7), waiter("back", seq=3)]
    assert order(waiters, now) == ["back", "later"]


def test_slack_is_measured_from_now() -> None:
    a = waiter("a", seq=1, deadline=100.0, estimate_s=0.0)
    b = waiter("b", seq=2, deadline=130.0, estimate_s=25.0)
    assert order([a, b], now=0.0) == ["a", "b"]  # slack 100 against 105
    assert a.slack(90.0) == 10.0 and b.slack(90.0) == 15.0
