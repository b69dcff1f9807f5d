"""The step engine's scheduling (dit_svc/step_engine.py) with a fake denoiser: members one after another with one
slot, at most `slots` and `work_limit` at once, a failed step fails its group alone, a member whose call ended
leaves at the next boundary."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from dit_svc.batching import request_work
from dit_svc.step_engine import Member, StepEngine
from stagediff.v1 import stages_pb2
from stagekit.denoise import DenoiseSpec
from stagekit.denoise_steps import DenoiseRun

SPEC = DenoiseSpec(height=16, width=16, num_frames=1, num_inference_steps=3, guidance_scale=1.0, seed=0)


class ComputeThread:
    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def compute_queued(self) -> bool:
        return False


class Counting:
    """Runs of `num_inference_steps` steps; records which seeds shared each step; a seed of 13 fails its step."""

    runs_steps = True

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def begin(self, spec: DenoiseSpec, conditioning: dict, state: Any = None) -> DenoiseRun:
        timesteps = torch.arange(spec.num_inference_steps)
        return DenoiseRun(spec, torch.zeros(1, 1, 1, 2, 2), None, timesteps, digest="")

    def step(self, runs: list[DenoiseRun]) -> None:
        self.steps.append([run.spec.seed for run in runs])
        if any(run.spec.seed == 13 for run in runs):
            raise RuntimeError("step failed")
        for run in runs:
            run.step_index += 1

    def result(self, run: DenoiseRun) -> torch.Tensor:
        return run.latents


async def outcome(engine: StepEngine, member: Member) -> Any:
    try:
        return [item async for item in engine.stream(member)]
    except RuntimeError as error:
        return error


def run_members(slots: int, seeds: list[int], work_limit: int | None = None) -> tuple[Counting, list[Any]]:
    denoiser = Counting()

    async def scenario() -> list[Any]:
        engine = StepEngine(ComputeThread(), denoiser, slots, work_limit)  # type: ignore[arg-type]
        members = [Member(dataclasses.replace(SPEC, seed=seed), {}) for seed in seeds]
        try:
            return await asyncio.gather(*(outcome(engine, member) for member in members))
        finally:
            await engine.stop()

    return denoiser, asyncio.run(scenario())


def test_one_slot_runs_members_one_after_another_in_arrival_order() -> None:
    denoiser, results = run_members(1, [1, 2])
    assert denoiser.steps == [[1]] * 3 + [[2]] * 3
    for items in results:
        assert [item.step for item in items if isinstance(item, stages_pb2.DenoiseProgress)] == [1, 2, 3]
        assert isinstance(items[-1], torch.Tensor)


def test_slots_and_work_bound_who_shares_a_step() -> None:
    denoiser, _ = run_members(2, [1, 2, 3])
    assert denoiser.steps[:3] == [[1, 2]] * 3 and denoiser.steps[3:] == [[3]] * 3
    denoiser, _ = run_members(3, [1, 2, 3], work_limit=2 * request_work(SPEC))
    assert denoiser.steps[0] == [1, 2]


def test_a_failed_step_fails_its_group_and_the_engine_goes_on() -> None:
    denoiser, results = run_members(1, [13, 2])
    assert isinstance(results[0], RuntimeError) and isinstance(results[1][-1], torch.Tensor)


class CountingThread(ComputeThread):
    """Counts the calls handed to the compute thread; `queued` says whether other work waits for it."""

    def __init__(self, queued: bool) -> None:
        self.calls, self.queued = 0, queued

    async def run(self, fn: Any, *args: Any) -> Any:
        self.calls += 1
        return await super().run(fn, *args)

    def compute_queued(self) -> bool:
        return self.queued


def test_iterations_run_back_to_back_unless_other_work_waits_for_the_thread() -> None:
    def calls(queued: bool) -> tuple[int, list[list[int]]]:
        thread, denoiser = CountingThread(queued), Counting()

        async def scenario() -> None:
            engine = StepEngine(thread, denoiser)  # type: ignore[arg-type]
            try:
                await outcome(engine, Member(dataclasses.replace(SPEC, seed=1), {}))
            finally:
                await engine.stop()

        asyncio.run(scenario())
        return thread.calls, denoiser.steps

    assert calls(queued=False) == (1, [[1]] * 3)  # one call runs all three steps
    assert calls(queued=True) == (3, [[1]] * 3)  # one step per call: the other work runs between them
