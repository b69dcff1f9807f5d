"""CFG-parallel: the two guidance branches of a step on two rank groups.

With classifier-free guidance every step runs the transformer twice, once on
the prompt and once on the negative prompt. With `--cfg-parallel-size 2` the
ranks of cfg group 0 run the prompt branch and those of group 1 the negative
one, at the same time; the predictions are all-gathered, and every rank
combines them and steps its own copy of the scheduler, so all ranks keep
identical latents without sending them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def cfg_parallel_predictions(
    predict: Callable[[object, str], torch.Tensor],
    prompt_embeds: object,
    negative_prompt_embeds: object,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (cond, uncond) noise predictions; this rank computes only its own branch.

    `predict(conditioning, branch)` runs the transformer; `branch` is "cond" or "uncond".
    """
    branch = dist.get_rank(group)
    if branch == 0:
        local = predict(prompt_embeds, "cond").contiguous()
    else:
        local = predict(negative_prompt_embeds, "uncond").contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return gathered[0], gathered[1]


def agree_to_continue(keep_going: bool, device: torch.device) -> bool:
    """Rank 0 decides whether the group runs another step (it alone sees cancellations)."""
    flag = torch.tensor([1 if keep_going else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def agree_on_members(wanted: list[bool], device: torch.device) -> list[bool]:
    """Rank 0 decides which requests of a batch the group keeps denoising (it alone sees cancellations)."""
    flags = torch.tensor([1 if keep else 0 for keep in wanted], dtype=torch.int32, device=device)
    dist.broadcast(flags, src=0)
    return [bool(flag) for flag in flags.tolist()]
