"""What every family's denoising loop shares: the request's arguments, the stage's view of a denoiser, and
the two pieces of a step that do not depend on the model (agreeing to go on, running the guidance branches).

A family's denoiser (families/<family>/denoise.py) follows its diffusers pipeline step for step, so that
its latents equal the pipeline's for the same arguments. The stage constructs it with `make_denoiser`, which
asks the checkpoint's family in the registry which class that is, and runs each request with
`denoise_request`, which applies the request's step cache (dit_svc/step_cache.py) around the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dit_svc.model_options import ModelOptions
from dit_svc.parallel import ParallelConfig
from dit_svc.parallel.cfg import agree_to_continue, cfg_parallel_predictions
from dit_svc.step_cache import CachePasses, CacheSetting, CacheSpec, GroupConsensus, step_cache
from services.checkpoint import read_checkpoint
from services.stage import Cancelled


@dataclass(frozen=True)
class DenoiseSpec:
    """One request's denoising arguments, already validated."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    # Roles of the input images whose tensors condition the request (families/base.py IMAGE_ROLES), in the
    # model's role order, and the decoded size (width, height) of each, () when the caller sent none.
    image_roles: tuple[str, ...] = ()
    image_sizes: tuple[tuple[int, int], ...] = ()
    # The step cache of the request (its method "none" when it runs every pass).
    cache: CacheSpec = CacheSpec()

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1.0


class Denoiser(Protocol):
    """What the DiT stage asks of a family's denoiser."""

    transformer: torch.nn.Module
    # The rank group's layout, None on one rank; the process group of the CFG branches, None without CFG-parallel.
    parallel: ParallelConfig | None
    cfg_group: torch.distributed.ProcessGroup | None

    @property
    def experts(self) -> list[torch.nn.Module]:
        """Every transformer the loop runs (Wan2.2 A14B has two), as their stage reports them."""
        ...

    @property
    def text_dim(self) -> int:
        """The width of the embeddings the transformer takes."""
        ...

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The shape of a conditioning tensor made from the request's input images (families that take
        images; see TensorSlot.image), None in place of a token count; None when the request cannot take it."""
        ...

    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns float32 latents [1, C, T, h, w]; on_step(step, total) after each.

        `conditioning` holds the tensors the family declares (families/base.py TensorSlot), by name.
        """
        ...


def make_denoiser(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelConfig | None = None,
    options: ModelOptions | None = None,
    load_threads: int = 4,
) -> Denoiser:
    """The checkpoint's family's denoiser; every rank of a DiT group builds its own with this."""
    denoiser_class = read_checkpoint(model_dir).traits.load("denoiser")
    return denoiser_class(model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads)


def denoise_request(
    denoiser: Denoiser,
    spec: DenoiseSpec,
    conditioning: dict[str, torch.Tensor],
    on_step: Callable[[int, int], None],
    cancelled: Callable[[], bool],
    mag_ratios: dict[str, list[float]] | None = None,
    calibration: dict[str, dict[str, list[float]]] | None = None,
) -> tuple[torch.Tensor, CachePasses]:
    """Runs the request on this rank with its step cache; returns the latents and the request's passes.

    Every rank of a group calls it with the same request. The passes count every guidance branch of every
    step once: under CFG-parallel each rank ran one branch, so the counts are summed over the CFG group.
    """
    setting = CacheSetting(
        num_inference_steps=spec.num_inference_steps,
        height=spec.height,
        width=spec.width,
        image_to_video=bool(spec.image_roles),
        mag_ratios=mag_ratios,
        calibration=calibration,
    )
    consensus = GroupConsensus() if denoiser.parallel is not None else None
    with step_cache(denoiser.experts, spec.cache, setting, consensus) as passes:
        latents = denoiser.denoise(spec, conditioning, on_step, cancelled)
    branches = 2 if spec.do_classifier_free_guidance else 1
    if not spec.cache.enabled:
        return latents, CachePasses(run=spec.num_inference_steps * branches)
    if denoiser.cfg_group is not None and branches == 2:
        counts = torch.tensor([passes.run, passes.skipped], dtype=torch.int64, device=latents.device)
        torch.distributed.all_reduce(counts, group=denoiser.cfg_group)
        passes = CachePasses(run=int(counts[0]), skipped=int(counts[1]))
    return latents, passes


def stop_if_cancelled(cancelled: Callable[[], bool], parallel: ParallelConfig | None, device: torch.device) -> None:
    """Raises Cancelled before a step when the request is cancelled; in a group, rank 0's answer holds for all."""
    keep_going = not cancelled()
    if parallel is not None:
        keep_going = agree_to_continue(keep_going, device)
    if not keep_going:
        raise Cancelled()


def guidance_predictions(
    predict: Callable[[object, str], torch.Tensor],
    positive: object,
    negative: object,
    cfg_group: torch.distributed.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cond, uncond) predictions of a CFG step: both on this rank, or one branch per CFG rank group.

    `predict(conditioning, branch)` runs the transformer; `branch` is "cond" or "uncond".
    """
    if cfg_group is not None:
        return cfg_parallel_predictions(predict, positive, negative, cfg_group)
    return predict(positive, "cond"), predict(negative, "uncond")
