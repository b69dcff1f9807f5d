"""What the ranks of a DiT group agree on, so that every rank takes the step cache's single-rank decision.

Under parallelism every rank must take the same decision, equal to one rank's, or the ranks would run
different collectives and hang. `GroupConsensus` makes it so: the first-block statistics are summed over the
DiT group before the threshold is compared (each rank holds a shard of the tokens under Ulysses and Ring;
tokens added as padding are left out, `valid_token_weights`), and every decision is all-reduced (any rank
that computes makes all compute). Under CFG-parallel both branches are in flight at once on different ranks;
each rank writes its branch's slot of the reduced vector, so one collective serves both branches and each
reads its own. MagCache's decision depends only on the step and the ratios, the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from stagekit.parallel.sequence_parallel import SequenceParallelState

# The guidance branches, in the order of their slots in a reduced vector.
BRANCHES = ("cond", "uncond")


class GroupConsensus:
    """Reductions over the DiT group that make every rank's decision the single-rank one (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        # None: the default group, which is the DiT's rank group.
        self.group = group

    def _slot(self, branch: str) -> int:
        return BRANCHES.index(branch)

    def sums(self, branch: str, values: torch.Tensor) -> torch.Tensor:
        """`values` [n] summed over the ranks that run `branch` now (all ranks under sequential CFG)."""
        packed = torch.zeros(len(BRANCHES), values.numel(), dtype=torch.float64, device=values.device)
        packed[self._slot(branch)] = values.to(torch.float64)
        dist.all_reduce(packed, group=self.group)
        return packed[self._slot(branch)]

    def agree(self, branch: str, compute: bool, device: torch.device) -> bool:
        """True when any rank of `branch` wants the full pass."""
        flags = torch.zeros(len(BRANCHES), dtype=torch.int32, device=device)
        flags[self._slot(branch)] = int(compute)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[self._slot(branch)].item())


def valid_token_weights(state: SequenceParallelState | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """[B, L, 1] with 0 on this rank's padding tokens (sequence parallelism pads to a multiple of the degree)."""
    if state is None:
        return None
    padding = state.key_padding_mask(hidden.shape[0], hidden.shape[1], hidden.device)
    return None if padding is None else (~padding).unsqueeze(-1).to(hidden.dtype)
