"""A job's pause and resume at a step boundary (preemption, handoff) as the SDK hands them over and the CLI shows
them: JobPaused and JobResumed become `Paused` and `Resumed` events, one line each in the plain progress."""

from __future__ import annotations

import io

from stagediff.client import Paused, Resumed
from stagediff.progress import PlainProgress
from stagediff.results import ResultBuilder
from stagediff.v1 import generation_pb2


def test_paused_and_resumed_events_carry_the_step_reason_and_count() -> None:
    assembler = ResultBuilder()
    paused = generation_pb2.GenerateEvent(
        job_id="j",
        paused=generation_pb2.JobPaused(stage="dit", step=7, total=30, reason="preempted", preemptions=2),
    )
    resumed = generation_pb2.GenerateEvent(job_id="j", resumed=generation_pb2.JobResumed(stage="dit", step=7, total=30))
    assert assembler.consume(paused) == [Paused("j", "dit", 7, 30, "preempted", 2)]
    assert assembler.consume(resumed) == [Resumed("j", "dit", 7, 30)]


def test_the_plain_progress_says_why_a_job_paused_and_where_it_resumed() -> None:
    stream = io.StringIO()
    show = PlainProgress(stream)
    show(Paused("j", "dit", 7, 30, "preempted", 1))
    show(Paused("j", "dit", 9, 30, "handoff", 1))
    show(Resumed("j", "dit", 9, 30))
    assert stream.getvalue().splitlines() == [
        "dit: paused at 7/30: preempted by a higher priority job (1 so far)",
        "dit: paused at 9/30: its replica is shutting down; continuing on another",
        "dit: resumed at 9/30",
    ]
