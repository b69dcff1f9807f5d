"""How far a continuous batch grows: while a row's share of a step keeps falling.

With `--continuous-batching` the step engine may step up to `--max-batch-size` requests of one shape together.
Whether a larger batch pays depends on the device. On a GPU a step of four rows costs little more than a step of
one, so a full batch gives nearly four times the throughput. On a CPU a step costs about the sum of its rows, and
four rows can cost more per row than two (larger activations, worse cache use): growing the batch then lowers
throughput AND raises every member's latency.

`BatchGrowth` (`--batch-growth measured`, the default) measures, per shape (`cost_key`: size, frames, guidance
branches and conditioning shapes), how long a step of n rows takes, and lets a shape's batch grow to n rows only
while the cost per row at n stays within `tolerance` of the cost per row at n - 1. Rules:
- a batch grows one size at a time: the smallest size measured fewer than `samples` times is allowed (running it
  is how it gets measured), the sizes above it are not;
- the first step of each size is not counted: it pays for the new shapes' memory and kernel choices;
- a size found too dear is measured afresh after `retry_after` more steps of its shape, because a CPU's cost moves
  with what else runs beside the stage;
- members already stepping are never removed: the bound applies when a waiting request is admitted;
- at most `max_shapes` shapes are remembered (least recently stepped forgotten), so that requests of ever new shapes
  cannot grow the table.
`--batch-growth full` admits up to `--max-batch-size` whatever a row costs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from stagekit.denoise import DenoiseSpec

logger = logging.getLogger(__name__)


def cost_key(spec: DenoiseSpec, conditioning: dict[str, torch.Tensor]) -> tuple:
    """What a row's cost depends on: its latent size (size and frames), guidance branches and conditioning shapes.
    Members of one step group (dit_svc/step_engine.py) always share it."""
    shapes = tuple(sorted((name, tuple(t.shape), str(t.dtype)) for name, t in conditioning.items()))
    return (spec.height, spec.width, spec.num_frames, spec.do_classifier_free_guidance, shapes)


@dataclass
class ShapeCosts:
    """One shape's step times by rows: a moving average, its sample count, and when each size was found too dear."""

    seconds: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # sizes whose first step went by
    logged: int = 0  # the bound last logged
    refused_at: dict[int, int] = field(default_factory=dict)  # rows -> `steps` when found too dear
    steps: int = 0


class BatchGrowth:
    def __init__(
        self,
        slots: int,
        *,
        tolerance: float = 0.02,
        samples: int = 3,
        retry_after: int = 200,
        smoothing: float = 0.2,
        max_shapes: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`slots`: the largest batch (--max-batch-size); `tolerance`: how much dearer a row may be in a larger
        batch; `samples`: steps of a size before it is judged; `retry_after`: steps of the shape before a size
        found too dear is measured again; `smoothing`: the moving average's weight of a new step; `clock`: what
        `measure` times with."""
        if slots < 1 or not 0 <= tolerance < 1 or samples < 1 or retry_after < 1 or not 0 < smoothing <= 1:
            raise ValueError(
                "BatchGrowth: slots >= 1, 0 <= tolerance < 1, samples >= 1, retry_after >= 1, 0 < smoothing <= 1"
            )
        self.slots = slots
        self.tolerance = tolerance
        self.samples = samples
        self.retry_after = retry_after
        self.smoothing = smoothing
        self.max_shapes = max_shapes
        self.clock = clock
        self.shapes: OrderedDict[tuple, ShapeCosts] = OrderedDict()

    @contextlib.contextmanager
    def measure(self, key: tuple, rows: int) -> Iterator[None]:
        """Times the step inside it and records it, unless it raised."""
        started = self.clock()
        yield
        self.record(key, rows, self.clock() - started)

    def record(self, key: tuple, rows: int, seconds: float) -> None:
        """One step of `rows` rows of shape `key` took `seconds`."""
        costs = self.shapes.pop(key, None) or ShapeCosts()
        self.shapes[key] = costs  # the most recently stepped last
        while len(self.shapes) > self.max_shapes:
            self.shapes.popitem(last=False)
        costs.steps += 1
        if rows not in costs.seen:
            costs.seen.add(rows)
            return
        count = costs.samples.get(rows, 0)
        previous = costs.seconds.get(rows)
        costs.seconds[rows] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
        costs.samples[rows] = count + 1

    def limit(self, key: tuple) -> int:
        """The most rows a batch of shape `key` may grow to now (1 to `slots`)."""
        costs = self.shapes.get(key)
        if costs is None or costs.samples.get(1, 0) < self.samples:
            return 1
        return self._limit(key, costs)

    def _limit(self, key: tuple, costs: ShapeCosts) -> int:
        for rows in range(2, self.slots + 1):
            if costs.samples.get(rows, 0) < self.samples:
                return rows  # not yet judged (every smaller size is): allowed, so that it is measured
            if costs.seconds[rows] / rows <= costs.seconds[rows - 1] / (rows - 1) * (1 + self.tolerance):
                costs.refused_at.pop(rows, None)
                continue
            if rows not in costs.refused_at and rows - 1 != costs.logged:
                costs.logged = rows - 1
                per_row = ", ".join(f"{n}: {costs.seconds[n] / n:.3f} s" for n in sorted(costs.seconds))
                logger.info(
                    "dit: batches of %s stay below %d rows (a step's time per row by rows: %s)", key[:4], rows, per_row
                )
            refused = costs.refused_at.setdefault(rows, costs.steps)
            if costs.steps - refused >= self.retry_after:  # measure it afresh
                del costs.refused_at[rows], costs.seconds[rows]
                costs.samples[rows] = 0
                costs.seen.discard(rows)
                return rows
            return rows - 1
        return self.slots
