"""Seconds per denoising step by shape (a bounded, exponentially weighted mean) and the deadline check."""

from __future__ import annotations

import math

import pytest

from services.orchestrator.step_times import ShapeKey, StepTimes, deadline_check


def key(model: str = "wan", height: int = 480, width: int = 832, frames: int = 81, cfg: bool = True) -> ShapeKey:
    return ShapeKey(model, height, width, frames, cfg)


def test_the_first_observation_is_the_mean_then_each_moves_it_by_alpha() -> None:
    times = StepTimes(alpha=0.25)
    times.observe(key(), 2.0)
    assert times.mean(key()) == 2.0
    times.observe(key(), 4.0)
    assert times.mean(key()) == 2.5  # 2 + 0.25 * (4 - 2)
    times.observe(key(), 0.5)
    assert times.mean(key()) == 2.0  # 2.5 + 0.25 * (0.5 - 2.5)
    assert times.estimate(key(), 30) == 60.0
    assert times.estimate(key(), 0) == 0.0


def test_shapes_are_kept_apart() -> None:
    times = StepTimes()
    times.observe(key(cfg=True), 2.0)
    times.observe(key(cfg=False), 1.5)
    times.observe(key(model="ltx"), 7.0)
    assert times.mean(key(cfg=True)) == 2.0
    assert times.mean(key(cfg=False)) == 1.5
    assert times.mean(key(model="ltx")) == 7.0


def test_an_unobserved_model_has_no_estimate() -> None:
    times = StepTimes()
    assert times.estimate(key(), 10) is None
    times.observe(key(model="other"), 1.0)
    assert times.estimate(key(), 10) is None


def test_an_unobserved_shape_borrows_the_nearest_of_its_model_scaled_by_work() -> None:
    times = StepTimes()
    times.observe(key(height=256, width=256, frames=1, cfg=False), 0.5)  # work 65,536
    times.observe(key(height=1024, width=1024, frames=1, cfg=False), 4.0)  # work 1,048,576
    times.observe(key(model="ltx", height=512, width=512, frames=1, cfg=False), 100.0)  # another model: ignored
    # 512x512 (262,144) is 4x the small shape and 1/4 of the large one: a tie, the smaller work is borrowed.
    assert times.estimate(key(height=512, width=512, frames=1, cfg=False), 10) == 0.5 * 4 * 10
    # 768x768 (589,824) is 9x the small one and 1/1.78 of the large one: the large one, scaled down.
    assert times.estimate(key(height=768, width=768, frames=1, cfg=False), 2) == pytest.approx(
        4.0 * 589_824 / 1_048_576 * 2
    )
    # Guidance doubles the work: 512x512 with it is 524,288, nearest the large shape (ratio 2 against 8).
    assert times.estimate(key(height=512, width=512, frames=1, cfg=True), 1) == 4.0 * 524_288 / 1_048_576
    # Frames count like pixels.
    assert times.estimate(key(height=256, width=256, frames=4, cfg=False), 1) == 0.5 * 4


def test_keys_are_bounded_dropping_the_least_recently_used() -> None:
    times = StepTimes(max_keys=3)
    for frames in (1, 2, 3):
        times.observe(key(frames=frames), float(frames))
    assert times.estimate(key(frames=1), 1) == 1.0  # using frames=1 makes frames=2 the least recently used
    times.observe(key(frames=4), 4.0)
    assert len(times) == 3
    assert key(frames=2) not in times
    assert [key(frames=f) in times for f in (1, 3, 4)] == [True, True, True]
    for frames in range(5, 1000):
        times.observe(key(frames=frames), 1.0)
    assert len(times) == 3


def test_bad_observations_and_arguments_are_refused() -> None:
    times = StepTimes()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="^seconds_per_step: "):
            times.observe(key(), bad)
    with pytest.raises(ValueError, match="^steps: "):
        times.estimate(key(), -1)
    with pytest.raises(ValueError, match="^alpha: "):
        StepTimes(alpha=0.0)
    with pytest.raises(ValueError, match="^max_keys: "):
        StepTimes(max_keys=0)
    with pytest.raises(ValueError, match="^height: "):
        key(height=0)
    assert len(times) == 0


def test_deadline_check_shares_the_work_ahead_among_the_slots() -> None:
    # 40 s of work ahead over 2 slots is 20 s, then 30 s of its own: it finishes 50 s from now.
    assert deadline_check(100.0, 150.0, own_s=30.0, ahead_s=40.0, slots=2) is None
    assert deadline_check(100.0, 149.0, own_s=30.0, ahead_s=40.0, slots=2) == 50.0
    assert deadline_check(100.0, 149.0, own_s=30.0, ahead_s=40.0, slots=4) is None  # 10 + 30 = 40 s
    assert deadline_check(100.0, 120.0, own_s=30.0, ahead_s=0.0, slots=1) == 30.0
    assert deadline_check(100.0, None, own_s=1e9, ahead_s=1e9, slots=1) is None
    with pytest.raises(ValueError, match="^slots: "):
        deadline_check(0.0, 1.0, own_s=1.0, ahead_s=1.0, slots=0)
    with pytest.raises(ValueError, match="^own_s: "):
        deadline_check(0.0, 1.0, own_s=-1.0, ahead_s=1.0, slots=1)
