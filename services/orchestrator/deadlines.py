"""Admission against a request's deadline: refused at once when the DiT cannot finish it in time.

A job that asks for a deadline (GenerateRequest.deadline_s) is admitted only when the work ahead of it at the DiT
and its own denoising fit before it (`step_times.deadline_check`). The estimates come from
the DiT's recent step times per shape (`StepTimes`, fed by every job's progress): a job's work is its steps left
times the seconds per step of its shape. The work ahead is that of the model's active jobs (queued or running) of
its priority class or a higher one, spread over the DiT slots serving the model; jobs of lower classes are not
counted where preemption is on (they yield to it). Where nothing has been measured yet for the model, or no
replica serves it (a pool at zero), there is nothing to judge by and the job is admitted: its deadline still
cancels it when it passes.

A call's own gRPC deadline (the SDK's `timeout`) orders the job by slack at the DiT gate and cancels it when it
passes, as `deadline_s` does, but is not refused here: it is a guard a client sets on its wait, often loosely,
while `deadline_s` says when the result stops being useful, which is what a refusal may act on.

A refusal is an `AdmissionRefused` (RESOURCE_EXHAUSTED, scope "deadline") naming `deadline_s`, with the estimated
finish and a retry-after of the time the work ahead of it needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.orchestrator.denoise_call import shape_key
from services.orchestrator.dit_gate import DitGate
from services.orchestrator.job import Job
from services.orchestrator.routes import ModelRoutes
from services.orchestrator.scheduler import AdmissionRefused, Priority
from services.orchestrator.step_times import StepTimes, deadline_check
from stagediff.v1 import generation_pb2


class DeadlineAdmission:
    """Refuses at admission the jobs whose deadline the DiT cannot meet (see the module docstring)."""

    def __init__(self, step_times: StepTimes, gate: DitGate, routes: ModelRoutes, *, preemption: bool) -> None:
        self.step_times = step_times
        self.gate = gate
        self.routes = routes
        self.preemption = preemption

    def remaining_s(self, job: Job) -> float:
        """Seconds of denoising the job has left, by its shape's recent step times (0 where none is known)."""
        route = self.routes.get(job.request.model)
        if route is None:
            return 0.0
        step, total = job.steps.get("dit", (0, job.request.num_inference_steps))
        cfg = job.request.guidance_scale > route.family.cfg_threshold
        return self.step_times.estimate(shape_key(job.request, cfg), max(0, total - step)) or 0.0

    def check(
        self,
        request: generation_pb2.GenerateRequest,
        tenant: str,
        priority: Priority,
        deadline_in_s: float | None,
        active: Iterable[Job],
    ) -> None:
        """Raises AdmissionRefused when a job of `request`, due `deadline_in_s` from now, cannot be done in time."""
        route = self.routes.get(request.model)
        if deadline_in_s is None or route is None:
            return
        cfg = request.guidance_scale > route.family.cfg_threshold
        own = self.step_times.estimate(shape_key(request, cfg), request.num_inference_steps)
        slots = self.gate.slots_for(route)
        if own is None or slots == 0:
            return
        ahead = sum(
            self.remaining_s(job)
            for job in active
            if not job.finished
            and job.request.model == request.model
            and (not self.preemption or Priority.parse(job.priority) >= priority)
        )
        late = deadline_check(0.0, deadline_in_s, own, ahead, slots)
        if late is None:
            return
        raise AdmissionRefused(
            f"deadline_s: the job would finish in about {late:.1f} s, after its deadline of {deadline_in_s:.1f} s "
            f"({own:.1f} s of denoising behind {ahead:.1f} s of work ahead on {slots} DiT slot(s)); allow more time, "
            "or retry later",
            retry_after_s=max(1.0, ahead / slots),
            scope="deadline",
            tenant=tenant,
            model=request.model,
        )
