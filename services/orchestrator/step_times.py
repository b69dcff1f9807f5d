"""How long a denoising step takes, by the shape of the request, and whether a job can meet its deadline.

`StepTimes` keeps, per `ShapeKey` (model, height, width, frames, classifier-free guidance on or off), an
exponentially weighted mean of the seconds per step the DiT replicas reported: the first observation is the mean,
each later one x moves it to mean + alpha * (x - mean), so recent load and placement count most. It keeps at most
`max_keys` shapes, dropping the least recently used one: the keys come from requests, and hostile traffic must not
grow it without bound.

`estimate(key, steps)` is the mean of `key` times `steps`. A shape never observed borrows the nearest observed shape
of the same model, scaled linearly by work, where work is height x width x frames x guidance branches (2 with
guidance, 1 without): the nearest is the one whose work differs by the smallest ratio (ties: the smaller work, then
the smaller key). A model with no observed shape has no estimate (None).

`deadline_check` says whether a job can meet its deadline given its own work and the work ahead of it at the DiT
gate (the jobs before it in `preemption.gate_order`), shared by the slots that serve them.

Pure bookkeeping: no asyncio, no clock (callers pass `now`); the nearest-shape comparison is made on exact
fractions. `observe` and an exact `estimate` cost O(1), a borrowed estimate O(keys).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction

DEFAULT_ALPHA = 0.3
DEFAULT_MAX_KEYS = 256


@dataclass(frozen=True, order=True)
class ShapeKey:
    """What a denoising step's duration depends on: the model and the latent's shape, and guidance on or off."""

    model: str
    height: int
    width: int
    num_frames: int
    cfg: bool

    def __post_init__(self) -> None:
        for name, least in (("height", 1), ("width", 1), ("num_frames", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: {value!r}; must be an integer of at least {least}")

    @property
    def work(self) -> int:
        """Pixels x frames (an image: 1) x guidance branches: what a step's time is scaled by between shapes."""
        return self.height * self.width * max(1, self.num_frames) * (2 if self.cfg else 1)


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: {value!r}; must be a finite number of seconds, 0 or more")


class StepTimes:
    """Recent seconds per denoising step by `ShapeKey`: an exponentially weighted mean, at most `max_keys` keys."""

    def __init__(self, *, alpha: float = DEFAULT_ALPHA, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if not (math.isfinite(alpha) and 0 < alpha <= 1):
            raise ValueError(f"alpha: {alpha!r}; must be above 0 and at most 1")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys: {max_keys!r}; must be an integer of at least 1")
        self.alpha = alpha
        self.max_keys = max_keys
        self._means: OrderedDict[ShapeKey, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._means)

    def __contains__(self, key: object) -> bool:
        return key in self._means

    def observe(self, key: ShapeKey, seconds_per_step: float) -> None:
        """Folds one observed step duration into the key's mean; the key becomes the most recently used."""
        _check_seconds("seconds_per_step", seconds_per_step)
        mean = self._means.pop(key, None)
        self._means[key] = float(seconds_per_step) if mean is None else mean + self.alpha * (seconds_per_step - mean)
        while len(self._means) > self.max_keys:
            self._means.popitem(last=False)

    def mean(self, key: ShapeKey) -> float | None:
        """The key's own mean seconds per step, or None when it was never observed (or was dropped)."""
        return self._means.get(key)

    def estimate(self, key: ShapeKey, steps: int) -> float | None:
        """Seconds for `steps` steps of `key`: its mean, else the nearest observed shape of its model scaled by
        work (module docstring); None when its model has no observed shape."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps: {steps!r}; must be an integer, 0 or more")
        mean = self._means.get(key)
        if mean is not None:
            self._means.move_to_end(key)
            return mean * steps
        work = key.work
        best: tuple[Fraction, int, ShapeKey] | None = None
        for other in self._means:
            if other.model != key.model:
                continue
            other_work = other.work
            ratio = Fraction(max(work, other_work), min(work, other_work))
            if best is None or (ratio, other_work, other) < best:
                best = (ratio, other_work, other)
        if best is None:
            return None
        nearest = best[2]
        return self._means[nearest] * work / best[1] * steps


def deadline_check(now: float, deadline: float | None, own_s: float, ahead_s: float, slots: int) -> float | None:
    """None when a job can finish by `deadline`, else its estimated finish in seconds from `now` (for the refusal).

    The estimate is the work ahead of it at the DiT gate (`ahead_s`: the sum of the remaining work of the jobs
    before it in gate order) divided by the `slots` serving them, plus its own work (`own_s`). A job without a
    deadline always can.
    """
    _check_seconds("own_s", own_s)
    _check_seconds("ahead_s", ahead_s)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots: {slots!r}; must be an integer of at least 1")
    if deadline is None:
        return None
    finish = ahead_s / slots + own_s
    return None if now + finish <= deadline else finish
