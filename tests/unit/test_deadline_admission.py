"""Admission against deadlines (services/orchestrator/deadlines.py): a job is refused at once, RESOURCE_EXHAUSTED
naming deadline_s with its estimate, when its own denoising and the work ahead of it on the model's DiT slots end
after its deadline; it is admitted when they fit, when nothing is measured yet, or when no replica serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.orchestrator.deadlines import DeadlineAdmission
from services.orchestrator.denoise_call import shape_key
from services.orchestrator.job import Job
from services.orchestrator.scheduler import AdmissionRefused, Priority
from services.orchestrator.step_times import StepTimes
from stagediff.v1 import generation_pb2

SHAPE = dict(model="m", height=64, width=64, num_frames=9, guidance_scale=5.0)


def request(steps: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(num_inference_steps=steps, **SHAPE)


def admission(slots: int = 1, *, preemption: bool = True, measured: bool = True) -> DeadlineAdmission:
    times = StepTimes()
    if measured:
        times.observe(shape_key(request(1), cfg=True), 0.5)  # half a second a step
    route = SimpleNamespace(family=SimpleNamespace(cfg_threshold=1.0))
    gate = SimpleNamespace(slots_for=lambda route: slots)
    routes = SimpleNamespace(get=lambda model: route if model == "m" else None)
    return DeadlineAdmission(times, gate, routes, preemption=preemption)  # type: ignore[arg-type]


def running(job_id: str, priority: str, step: int, total: int) -> Job:
    job = Job(job_id=job_id, request=request(total), priority=priority)
    job.steps["dit"] = (step, total)
    return job


def test_a_job_that_fits_is_admitted_and_one_that_does_not_is_refused_with_its_estimate() -> None:
    deadlines = admission()
    deadlines.check(request(10), "acme", Priority.NORMAL, 5.5, [])  # 5 s of its own
    with pytest.raises(AdmissionRefused) as refused:
        deadlines.check(request(10), "acme", Priority.NORMAL, 4.0, [])
    assert refused.value.scope == "deadline" and refused.value.tenant == "acme"
    assert str(refused.value).startswith("deadline_s: the job would finish in about 5.0 s, after its deadline of 4.0 s")


def test_the_work_ahead_counts_jobs_of_its_class_or_higher_over_the_slots() -> None:
    ahead = [running("high", "high", 4, 10), running("normal", "normal", 0, 10), running("low", "low", 0, 100)]
    # 3 s + 5 s ahead (the low job yields to it) on 2 slots, then its own 5 s: 9 s.
    admission(slots=2).check(request(10), "acme", Priority.NORMAL, 9.0, ahead)
    with pytest.raises(AdmissionRefused) as refused:
        admission(slots=2).check(request(10), "acme", Priority.NORMAL, 8.9, ahead)
    assert "behind 8.0 s of work ahead on 2 DiT slot(s)" in str(refused.value)
    assert refused.value.retry_after_s == pytest.approx(4.0)
    # Without preemption the low job's 50 s are ahead too.
    with pytest.raises(AdmissionRefused):
        admission(slots=2, preemption=False).check(request(10), "acme", Priority.NORMAL, 20.0, ahead)


def test_nothing_measured_no_replica_or_no_deadline_admits() -> None:
    admission(measured=False).check(request(10), "acme", Priority.LOW, 0.1, [])
    admission(slots=0).check(request(10), "acme", Priority.LOW, 0.1, [])
    admission().check(request(10), "acme", Priority.LOW, None, [])
