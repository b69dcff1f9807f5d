"""The DiT gate: which job denoises on which DiT replica slot, in the scheduler's order, and who yields for whom.

A DiT replica steps `StageInfo.step_slots` requests at once (its continuous batch's rows; 1 without continuous
batching; `--max-batch-size` for a replica that batches requests without stepping them). A job reaching its DiT
stage takes a slot here; when none is free it waits, and waiting jobs take freed slots in `gate_order`: priority
class first, then least slack (deadline minus estimated remaining work), then the order jobs first reached the gate.
A job that yielded waits again with that order, so it returns to the queue at its place.

When a waiting job cannot get a slot, the preemption policy (services/orchestrator/preemption.py) may pick a holder
of a lower class to yield: the gate asks its replica (the DiT's `Yield`), the holder's call ends at its next step
boundary with its state, its slot goes to the highest waiter, and the holder waits again with its state
(services/orchestrator/denoise_call.py continues it wherever a slot frees up). A holder asked once is not asked
again; one whose replica answers it cannot yield (a step cache, adapters, a replica that does not step requests) is
not asked again either.

Where no replica serves a job's model (a pool at zero), the first such job goes on to the stage's own wait for a
replica (a cold start) and the others wait here; the gate looks again whenever a slot is freed or a job arrives, and
every `RECHECK_S` for replicas that came or went.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from services.orchestrator.job import Job
from services.orchestrator.preemption import Holder, PreemptionPolicy, Waiter, choose_victim, gate_order
from services.orchestrator.routes import ModelRoute
from services.orchestrator.scheduler import Priority
from services.orchestrator.stage_clients import Stage, StageClient
from stagediff.v1 import stages_pb2

logger = logging.getLogger(__name__)

RECHECK_S = 0.5
YIELD_TIMEOUT_S = 5.0


def replica_slots(info: stages_pb2.StageInfo | None) -> int:
    """How many requests a DiT replica runs at once: its step slots, or the batch of a replica that batches requests
    without stepping them, else 1."""
    if info is None:
        return 1
    if info.step_scheduling:
        return max(1, info.step_slots)
    batch = info.parallel_config.get("max_batch_size", "1")
    return max(1, int(batch)) if batch.isdigit() else 1


@dataclass
class Slot:
    """A job's hold on a DiT replica: the replica, the id its Denoise call carries, and the progress it reports."""

    job: Job
    replica: StageClient | None  # None until the stage has a replica for a pool at zero
    call_id: str
    step: int = 0
    total: int = 0
    yield_asked: bool = False
    # The replica answered that this call cannot yield (or the request cannot: a step cache, adapters).
    unyieldable: bool = False


@dataclass
class _Waiting:
    job: Job
    route: ModelRoute
    seq: int
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DitGate:
    """The DiT stage's slots and the jobs waiting for them (one gate per orchestrator, for every model)."""

    def __init__(
        self,
        stage: Stage,
        policy: PreemptionPolicy,
        tenant_info: Callable[[str], tuple[float, bool]],
        estimate: Callable[[Job], float | None] | None = None,
    ) -> None:
        """`tenant_info(tenant)`: its weight and whether its jobs may be preempted. `estimate(job)`: seconds of
        denoising the job has left (None: unknown), for the slack of jobs with a deadline."""
        self.stage = stage
        self.policy = policy
        self.tenant_info = tenant_info
        self.estimate = estimate
        self.holding: dict[str, Slot] = {}  # job id -> its slot
        self.waiting: list[_Waiting] = []
        self._seq = itertools.count()
        self._order: dict[str, int] = {}  # job id -> its place in the queue, kept across its yields
        self._changed = asyncio.Event()
        self._worker: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def slot(self, job: Job, route: ModelRoute) -> AsyncIterator[Slot]:
        """Waits for a slot on a replica serving the job's model, in gate order, and holds it for the block. The
        slot's replica is None where no replica serves the model yet: the call waits for one in the stage."""
        seq = self._order.setdefault(job.job_id, next(self._seq))
        waiting = _Waiting(job, route, seq)
        self.waiting.append(waiting)
        self._wake()
        try:
            slot = await waiting.granted
        except BaseException:
            if waiting.granted.done() and not waiting.granted.cancelled():
                self.holding.pop(job.job_id, None)  # granted just as its job was cancelled
                self._wake()
            raise
        finally:
            if waiting in self.waiting:
                self.waiting.remove(waiting)
        try:
            yield slot
        finally:
            self.holding.pop(job.job_id, None)
            self._wake()

    def forget(self, job_id: str) -> None:
        """The job's denoising is over: its place in the queue is given up."""
        self._order.pop(job_id, None)

    # ------------------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="dit-gate")

    async def _work(self) -> None:
        """Grants slots while jobs wait; looks again on every change, and every RECHECK_S for replicas."""
        while self.waiting:
            self._changed.clear()
            self._grant()
            if not self.waiting:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RECHECK_S)

    def slots_for(self, route: ModelRoute) -> int:
        """The DiT slots of the replicas serving the route's model now (0 for a pool at zero)."""
        return sum(replica_slots(replica.info) for replica in self.stage.serving(route.accepts("dit")))

    def _free_replica(self, route: ModelRoute) -> StageClient | None:
        """A serving replica of the route's model with a free slot (the fewest held first)."""
        held = Counter(id(slot.replica) for slot in self.holding.values() if slot.replica is not None)
        free = [
            replica
            for replica in self.stage.serving(route.accepts("dit"))
            if held[id(replica)] < replica_slots(replica.info)
        ]
        return min(free, key=lambda replica: held[id(replica)]) if free else None

    def _grant(self) -> None:
        now = asyncio.get_running_loop().time()
        by_id = {waiting.job.job_id: waiting for waiting in self.waiting if not waiting.granted.done()}
        blocked: set[str] = set()  # models whose next job cannot start: the later ones wait behind it
        for waiter in gate_order([self._as_waiter(waiting, now) for waiting in by_id.values()], now):
            waiting = by_id[waiter.job_id]
            model = waiting.route.model
            if model in blocked:
                continue
            replica = self._free_replica(waiting.route)
            if replica is None:
                blocked.add(model)
                if self.stage.serving(waiting.route.accepts("dit")):
                    self._maybe_preempt(waiter, waiting.route)
                    continue
                # No replica serves the model (a pool at zero): one job goes on to wait for one in the stage.
                if any(slot.replica is None and slot.job.request.model == model for slot in self.holding.values()):
                    continue
            slot = Slot(waiting.job, replica, call_id=secrets.token_hex(16))
            self.holding[waiter.job_id] = slot
            waiting.granted.set_result(slot)

    def _as_waiter(self, waiting: _Waiting, now: float) -> Waiter:
        job = waiting.job
        estimate = self.estimate(job) if self.estimate is not None and job.deadline is not None else None
        return Waiter(
            job_id=job.job_id,
            tenant=job.tenant,
            priority=int(Priority.parse(job.priority)),
            seq=waiting.seq,
            deadline=job.deadline,
            estimate_s=estimate,
        )

    def _maybe_preempt(self, waiter: Waiter, route: ModelRoute) -> None:
        if not self.policy.enabled:
            return
        accepts = route.accepts("dit")
        holders = []
        running: Counter[str] = Counter()
        for slot in self.holding.values():
            running[slot.job.tenant] += 1
            info = slot.replica.info if slot.replica is not None else None
            if slot.yield_asked or slot.unyieldable or info is None or not accepts(info):
                continue
            weight, preemptible = self.tenant_info(slot.job.tenant)
            request = slot.job.request
            holders.append(
                Holder(
                    job_id=slot.job.job_id,
                    tenant=slot.job.tenant,
                    priority=int(Priority.parse(slot.job.priority)),
                    step=slot.step,
                    total=slot.total or request.num_inference_steps,
                    preemptions=slot.job.preemptions,  # kept in the store across restarts
                    preemptible=(
                        preemptible
                        and info.step_scheduling
                        and not request.loras
                        and request.cache.method in ("", "none")
                    ),
                    weight=weight,
                    seq=self._order.get(slot.job.job_id, 0),
                )
            )
        victim = choose_victim(waiter, holders, self.policy, running)
        if victim is None:
            return
        slot = self.holding[victim.job_id]
        slot.yield_asked = True
        logger.info("job %s yields its DiT slot at its next step to job %s", victim.job_id, waiter.job_id)
        asyncio.get_running_loop().create_task(self._ask_to_yield(slot), name=f"yield-{victim.job_id}")

    async def _ask_to_yield(self, slot: Slot) -> None:
        assert slot.replica is not None  # only holders on a replica are asked
        try:
            answer = await slot.replica.denoiser.Yield(
                stages_pb2.YieldRequest(call_id=slot.call_id), timeout=YIELD_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:  # the call ended meanwhile (NOT_FOUND), or the replica is gone
            logger.info("job %s: Yield: %s", slot.job.job_id, error.details())
            if error.code() != grpc.StatusCode.NOT_FOUND:
                slot.unyieldable = True
            return
        if not answer.yielding:
            logger.info("job %s cannot yield: %s", slot.job.job_id, answer.reason)
            slot.unyieldable = True
            self._wake()  # another holder may yield instead
