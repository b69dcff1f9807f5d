"""The DiT gate (services/orchestrator/dit_gate.py) on fake replicas: slots granted in priority order, a holder of a
lower class asked to yield for a waiting job and its slot going to that job, no one asked with preemption off or for
a holder that cannot yield, and a pool at zero letting one job through to wait for a replica."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.orchestrator.dit_gate import DitGate, replica_slots
from services.orchestrator.job import Job
from services.orchestrator.preemption import PreemptionPolicy
from stagediff.v1 import generation_pb2, stages_pb2


@dataclass
class FakeDenoiser:
    yields: list[str] = field(default_factory=list)
    answer: bool = True

    async def Yield(self, request: stages_pb2.YieldRequest, timeout: float) -> stages_pb2.YieldResponse:  # noqa: N802
        self.yields.append(request.call_id)
        return stages_pb2.YieldResponse(yielding=self.answer, reason="" if self.answer else "a step cache")


@dataclass
class FakeReplica:
    endpoint: str
    info: stages_pb2.StageInfo = field(default_factory=lambda: stages_pb2.StageInfo(step_scheduling=True, step_slots=1))
    denoiser: FakeDenoiser = field(default_factory=FakeDenoiser)
    serving: bool = True


class FakeStage:
    def __init__(self, replicas: list[FakeReplica]) -> None:
        self.replicas = replicas

    def serving(self, accepts=None) -> list[FakeReplica]:
        return [replica for replica in self.replicas if replica.serving]


class FakeRoute:
    model = "m"

    def accepts(self, stage: str, call: str = ""):
        return lambda info: True


def job(job_id: str, priority: str, tenant: str = "t", steps: int = 20) -> Job:
    request = generation_pb2.GenerateRequest(model="m", num_inference_steps=steps)
    return Job(job_id=job_id, request=request, tenant=tenant, priority=priority)


async def hold(gate: DitGate, held: dict, release: dict, the_job: Job) -> None:
    async with gate.slot(the_job, FakeRoute()) as slot:  # type: ignore[arg-type]
        held[the_job.job_id] = slot
        await release.setdefault(the_job.job_id, asyncio.Event()).wait()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def make_gate(replicas: list[FakeReplica], policy: PreemptionPolicy | None = None, preemptible=True) -> DitGate:
    return DitGate(FakeStage(replicas), policy or PreemptionPolicy(), lambda tenant: (1.0, preemptible))  # type: ignore[arg-type]


def test_replica_slots_come_from_step_slots_or_a_batching_replica() -> None:
    assert replica_slots(stages_pb2.StageInfo(step_scheduling=True, step_slots=4)) == 4
    assert replica_slots(stages_pb2.StageInfo(parallel_config={"max_batch_size": "3"})) == 3
    assert replica_slots(stages_pb2.StageInfo()) == 1
    assert replica_slots(None) == 1


def test_a_high_job_makes_the_low_holder_with_least_progress_yield_and_takes_its_slot() -> None:
    async def scenario() -> None:
        replicas = [FakeReplica("a"), FakeReplica("b")]
        gate = make_gate(replicas)
        held: dict = {}
        release: dict = {}
        tasks = [asyncio.create_task(hold(gate, held, release, job(name, "low"))) for name in ("low1", "low2")]
        await settle()
        assert set(held) == {"low1", "low2"}
        assert held["low1"].replica is not held["low2"].replica
        held["low1"].step, held["low1"].total = 12, 20  # as their Denoise calls report them
        held["low2"].step, held["low2"].total = 3, 20
        tasks.append(asyncio.create_task(hold(gate, held, release, job("high", "high"))))
        await settle()
        victim = held["low2"]
        assert victim.replica.denoiser.yields == [victim.call_id]  # fewest steps done
        assert held["low1"].replica.denoiser.yields == []
        assert "high" not in held
        release["low2"].set()  # its call ends at the step boundary
        await settle()
        assert held["high"].replica is victim.replica
        for event in release.values():
            event.set()
        release.setdefault("high", asyncio.Event()).set()
        await asyncio.gather(*tasks)
        assert not gate.holding

    asyncio.run(scenario())


def test_freed_slots_go_to_the_higher_class_first_whatever_the_arrival() -> None:
    async def scenario() -> None:
        gate = make_gate([FakeReplica("a")], PreemptionPolicy(enabled=False))
        held: dict = {}
        release: dict = {}
        tasks = [asyncio.create_task(hold(gate, held, release, job("first", "low")))]
        await settle()
        for name, priority in (("normal", "normal"), ("low", "low"), ("high", "high")):
            tasks.append(asyncio.create_task(hold(gate, held, release, job(name, priority))))
            await settle()
        order = []
        for _ in range(4):
            current = [name for name in held if name not in order]
            assert len(current) == 1, current
            order.append(current[0])
            release.setdefault(current[0], asyncio.Event()).set()
            await settle()
        assert order == ["first", "high", "normal", "low"]
        assert gate.stage.replicas[0].denoiser.yields == []  # preemption off: nobody asked
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


@pytest.mark.parametrize("reason", ["tenant", "replica"])
def test_a_holder_that_may_not_yield_is_not_asked(reason: str) -> None:
    async def scenario() -> None:
        replica = FakeReplica("a")
        if reason == "replica":
            replica.info = stages_pb2.StageInfo(step_scheduling=False)
        gate = make_gate([replica], preemptible=reason != "tenant")
        held: dict = {}
        release: dict = {}
        tasks = [asyncio.create_task(hold(gate, held, release, job("low", "low")))]
        await settle()
        tasks.append(asyncio.create_task(hold(gate, held, release, job("high", "high"))))
        await settle()
        assert replica.denoiser.yields == [] and "high" not in held
        for name in ("low", "high"):
            release.setdefault(name, asyncio.Event()).set()
            await settle()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_pool_at_zero_lets_one_job_through_to_wait_for_a_replica() -> None:
    async def scenario() -> None:
        replica = FakeReplica("a", serving=False)
        gate = make_gate([replica])
        held: dict = {}
        release: dict = {}
        tasks = [asyncio.create_task(hold(gate, held, release, job(name, "normal"))) for name in ("one", "two")]
        await settle()
        assert list(held) == ["one"] and held["one"].replica is None
        replica.serving = True
        release["one"].set()
        await settle()
        assert held["two"].replica is replica
        release.setdefault("two", asyncio.Event()).set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
