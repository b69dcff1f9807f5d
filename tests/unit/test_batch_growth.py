"""How far a continuous batch grows (dit_svc/batch_growth.py): one size at a time while a row's share of a step
falls, a size found too dear measured afresh later, the table of shapes bounded; and the step engine admitting by
it (dit_svc/step_engine.py), with step times from a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest
import torch

from dit_svc.batch_growth import BatchGrowth, cost_key
from dit_svc.config import Batching
from dit_svc.step_engine import Member, StepEngine
from stagediff.v1 import stages_pb2
from stagekit.denoise import DenoiseSpec
from stagekit.denoise_steps import DenoiseRun

SPEC = DenoiseSpec(height=16, width=16, num_frames=1, num_inference_steps=12, guidance_scale=1.0, seed=0)
SHAPE = ("16x16",)
# A step's seconds by rows: a CPU, where four rows cost more per row than two, and a GPU, where rows are nearly free.
CPU = {1: 1.0, 2: 1.9, 3: 3.3, 4: 4.4}
GPU = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}


def measured(costs: dict[int, float], sizes: list[int], **options: Any) -> BatchGrowth:
    growth = BatchGrowth(4, **options)
    for rows in sizes:
        for _ in range(1 + growth.samples):  # its first step is not counted
            growth.record(SHAPE, rows, costs[rows])
    return growth


def test_a_new_shape_runs_alone_until_a_row_alone_is_measured() -> None:
    growth = BatchGrowth(4)
    assert growth.limit(SHAPE) == 1
    growth.record(SHAPE, 1, 9.0)  # a first step is not counted
    growth.record(SHAPE, 1, 1.0)
    growth.record(SHAPE, 1, 1.0)
    assert growth.limit(SHAPE) == 1
    growth.record(SHAPE, 1, 1.0)
    assert growth.limit(SHAPE) == 2  # the next size, to be measured
    assert growth.shapes[SHAPE].seconds[1] == 1.0
    assert growth.limit(("another shape",)) == 1


def test_the_batch_grows_one_size_at_a_time_while_a_row_gets_cheaper() -> None:
    assert measured(CPU, [1]).limit(SHAPE) == 2
    assert measured(CPU, [1, 2]).limit(SHAPE) == 3  # 0.95 s a row at 2: the next size is tried
    assert measured(CPU, [1, 2, 3]).limit(SHAPE) == 2  # 1.1 s a row at 3: dearer than at 2
    assert measured(GPU, [1, 2, 3]).limit(SHAPE) == 4
    assert measured(GPU, [1, 2, 3, 4]).limit(SHAPE) == 4


def test_a_row_slightly_dearer_within_the_tolerance_still_grows_the_batch() -> None:
    costs = {1: 1.0, 2: 2.03, 3: 3.3, 4: 4.0}  # 1.5% dearer a row at 2
    assert measured(costs, [1, 2], tolerance=0.02).limit(SHAPE) == 3
    assert measured(costs, [1, 2], tolerance=0.01).limit(SHAPE) == 1


def test_a_size_found_too_dear_is_measured_afresh_after_retry_after_steps() -> None:
    growth = measured(CPU, [1, 2, 3], retry_after=10)
    assert growth.limit(SHAPE) == 2
    for _ in range(9):
        growth.record(SHAPE, 2, CPU[2])
        assert growth.limit(SHAPE) == 2
    growth.record(SHAPE, 2, CPU[2])
    assert growth.limit(SHAPE) == 3  # its old measure is dropped: three rows run again to be measured
    for _ in range(1 + growth.samples):
        growth.record(SHAPE, 3, 2.7)  # the load beside the stage went: three rows are cheap now
    assert growth.limit(SHAPE) == 4


def test_a_moving_average_follows_the_cost_as_it_changes() -> None:
    growth = measured(GPU, [1, 2])
    assert growth.limit(SHAPE) == 3
    for _ in range(20):
        growth.record(SHAPE, 2, 2.5)  # two rows now cost 1.25 s a row
    assert growth.limit(SHAPE) == 1


def test_the_shapes_remembered_are_bounded_least_recently_stepped_forgotten() -> None:
    growth = BatchGrowth(4, max_shapes=2)
    for shape in [("a",), ("b",), ("c",)]:
        for _ in range(4):
            growth.record(shape, 1, 1.0)
    assert list(growth.shapes) == [("b",), ("c",)]
    assert growth.limit(("a",)) == 1


@pytest.mark.parametrize(
    "options", [dict(slots=0), dict(slots=4, tolerance=1.0), dict(slots=4, samples=0), dict(slots=4, smoothing=0.0)]
)
def test_bad_settings_are_refused(options: dict) -> None:
    with pytest.raises(ValueError, match="BatchGrowth"):
        BatchGrowth(**options)


def test_the_cost_key_is_size_frames_guidance_and_conditioning_shapes_not_the_seed_or_steps() -> None:
    embeds = {"prompt_embeds": torch.zeros(1, 4, 8)}
    other = dataclasses.replace(SPEC, seed=5, num_inference_steps=30)
    assert cost_key(SPEC, embeds) == cost_key(other, {"prompt_embeds": torch.ones(1, 4, 8)})
    assert cost_key(SPEC, embeds) != cost_key(dataclasses.replace(SPEC, width=32), embeds)
    assert cost_key(SPEC, embeds) != cost_key(dataclasses.replace(SPEC, guidance_scale=5.0), embeds)
    assert cost_key(SPEC, embeds) != cost_key(SPEC, {"prompt_embeds": torch.zeros(1, 5, 8)})


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class ComputeThread:
    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def compute_queued(self) -> bool:
        return False


class Timed:
    """Runs whose step advances the fake clock by the cost of its rows; records each step's rows."""

    runs_steps = True

    def __init__(self, clock: Clock, costs: dict[int, float], hold_after: int = -1) -> None:
        self.clock, self.costs = clock, costs
        self.sizes: list[int] = []
        # The step after `hold_after` steps waits for `go` (a test's chance to add a member at a known step).
        self.hold_after, self.go = hold_after, threading.Event()

    def begin(self, spec: DenoiseSpec, conditioning: dict, state: Any = None) -> DenoiseRun:
        return DenoiseRun(spec, torch.zeros(1, 1, 1, 2, 2), None, torch.arange(spec.num_inference_steps), digest="")

    def step(self, runs: list[DenoiseRun]) -> None:
        if len(self.sizes) == self.hold_after:
            assert self.go.wait(30)
        self.sizes.append(len(runs))
        self.clock.now += self.costs[len(runs)]
        for run in runs:
            run.step_index += 1

    def result(self, run: DenoiseRun) -> torch.Tensor:
        return run.latents


def step_sizes(costs: dict[int, float], growth: bool, members: int = 6) -> list[int]:
    """The rows of each step when `members` requests of one shape arrive at once at an engine of 4 slots."""
    clock = Clock()
    denoiser = Timed(clock, costs)

    async def scenario() -> None:
        bound = BatchGrowth(4, clock=clock) if growth else None
        engine = StepEngine(ComputeThread(), denoiser, 4, None, bound)  # type: ignore[arg-type]
        requests = [Member(dataclasses.replace(SPEC, seed=seed), {}) for seed in range(members)]

        async def outcome(member: Member) -> list:
            return [item async for item in engine.stream(member)]

        try:
            await asyncio.gather(*(outcome(member) for member in requests))
        finally:
            await engine.stop()

    asyncio.run(scenario())
    assert sum(denoiser.sizes) == members * SPEC.num_inference_steps
    return denoiser.sizes


def test_the_engine_grows_a_batch_only_while_rows_get_cheaper() -> None:
    sizes = step_sizes(CPU, growth=True)
    # Alone for 4 steps (the first not counted), two rows for 4, then three rows (to be measured) until the first
    # member ends; from then on never more than two rows.
    assert sizes[:8] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert sizes[8] == 3 and max(sizes) == 3
    first_retired = 12  # the first member's last step
    assert max(sizes[first_retired:]) <= 2
    assert step_sizes(GPU, growth=True)[12:16] == [4, 4, 4, 4]  # where rows are nearly free the batch fills


def test_full_growth_admits_up_to_the_slots_at_once() -> None:
    assert step_sizes(CPU, growth=False)[:12] == [4] * 12


@pytest.mark.parametrize(
    "arguments, says",
    [
        ((4, 10.0, False, "full"), "--batch-growth full: only with --continuous-batching"),
        ((4, 10.0, True, "fastest"), "--batch-growth 'fastest': allowed measured, full"),
    ],
)
def test_the_growth_flag_is_checked(arguments: tuple, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Batching(*arguments)


LOW, NORMAL, HIGH = 2, 1, 0  # services/stage_priority.py's class ranks


def join_two_running_lows(rank: int) -> list[int]:
    """Two low members of a shape whose batch pays at two rows run; a third of class `rank` arrives at their
    second step. The rows of each step."""
    clock = Clock()
    denoiser = Timed(clock, CPU, hold_after=2)
    growth = BatchGrowth(4, clock=clock)
    spec = dataclasses.replace(SPEC, num_inference_steps=40)
    for rows in (1, 2, 3):
        for _ in range(1 + growth.samples):
            growth.record(cost_key(spec, {}), rows, CPU[rows])

    async def scenario() -> None:
        engine = StepEngine(ComputeThread(), denoiser, 4, None, growth)  # type: ignore[arg-type]
        late: list[asyncio.Task] = []

        async def follow(member: Member, then: Member | None = None) -> None:
            async for item in engine.stream(member):
                if then is not None and isinstance(item, stages_pb2.DenoiseProgress) and item.step == 2:
                    late.append(asyncio.create_task(follow(then)))
                    while then not in engine.waiting and then not in engine.active:  # waiting, or joined already
                        await asyncio.sleep(0.001)
                    denoiser.go.set()

        lows = [Member(dataclasses.replace(spec, seed=seed), {}, place=(LOW, seed)) for seed in (1, 2)]
        third = Member(dataclasses.replace(spec, seed=3), {}, place=(rank, 3))
        try:
            await asyncio.gather(follow(lows[0], third), follow(lows[1]))
            await asyncio.gather(*late)
        finally:
            await engine.stop()

    asyncio.run(scenario())
    return denoiser.sizes


def test_the_growth_bound_never_keeps_a_higher_class_waiting_behind_lower_rows() -> None:
    assert max(join_two_running_lows(HIGH)) == 3  # it joins the two lows at once
    assert max(join_two_running_lows(LOW)) == 2  # a third low waits for a row to leave


def test_waiting_members_are_admitted_by_class_then_arrival() -> None:
    clock = Clock()
    denoiser = Timed(clock, CPU)

    async def scenario() -> list[int]:
        engine = StepEngine(ComputeThread(), denoiser, 1)  # type: ignore[arg-type]
        finished: list[int] = []
        places = {1: (LOW, 1), 2: (NORMAL, 2), 3: (HIGH, 3), 4: (NORMAL, 4)}

        async def follow(seed: int) -> None:
            member = Member(dataclasses.replace(SPEC, seed=seed), {}, place=places[seed])
            async for _ in engine.stream(member):
                pass
            finished.append(seed)

        try:
            await asyncio.gather(*(follow(seed) for seed in places))
        finally:
            await engine.stop()
        return finished

    assert asyncio.run(scenario()) == [3, 2, 4, 1]
