"""The DiT stage as a process group (see services/rank_group.py for how the group runs).

The group may span several machines: node 0 is the stage (`DenoiserGroup`), every other node runs
`serve_dit_node`, which follows it. Every rank holds the family's denoiser (dit_svc/denoise.py make_denoiser) with
the same parallel layout; for each request rank 0 hands the embeddings to the followers and all ranks
run the denoising loop in step. At the start of each step rank 0 tells the group whether to go on
(dit_svc/parallel/cfg.py), so a cancelled request stops every rank within a step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dit_svc.denoise import Denoiser, DenoiseSpec, make_denoiser
from dit_svc.model_options import ModelOptions
from dit_svc.parallel import ParallelConfig
from services.auth import TLSConfigError, server_credentials_from_args
from services.rank_group import ONE_NODE, NodeLayout, RankGroup, serve_follower_node
from services.stage_main import prepare_stage_process


@dataclass(frozen=True)
class DitPayload:
    model_dir: str
    dtype: torch.dtype
    config: ParallelConfig
    options: ModelOptions
    load_threads: int = 4


class DitWorker:
    def __init__(self, denoiser: Denoiser) -> None:
        self.denoiser = denoiser

    def handle(self, message: tuple[DenoiseSpec, dict[str, torch.Tensor]]) -> torch.Tensor:
        spec, conditioning = message
        return self.denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)


def make_dit_worker(rank: int, device: torch.device, payload: DitPayload) -> DitWorker:
    return DitWorker(
        make_denoiser(
            payload.model_dir,
            device,
            payload.dtype,
            parallel=payload.config,
            options=payload.options,
            load_threads=payload.load_threads,
        )
    )


class DenoiserGroup:
    """Rank 0's denoiser: same interface as the family's denoiser, with every rank of the group in step."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        threads: int,
        config: ParallelConfig,
        options: ModelOptions,
        load_threads: int = 4,
        layout: NodeLayout = ONE_NODE,
    ) -> None:
        settings = layout.settings("dit", config.total_ranks, device.type, threads)
        payload = DitPayload(str(model_dir), dtype, config, options, load_threads)
        self.group = RankGroup(settings, make_dit_worker, payload, layout.channel)
        self.denoiser: Denoiser = self.group.worker.denoiser

    @property
    def transformer(self) -> torch.nn.Module:
        return self.denoiser.transformer

    @property
    def experts(self) -> list[torch.nn.Module]:
        return self.denoiser.experts

    @property
    def text_dim(self) -> int:
        return self.denoiser.text_dim

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        return self.denoiser.image_tensor_shape(name, spec)

    def failure(self) -> str | None:
        return self.group.failure()

    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        # A group that lost a rank or a node stops the request at the next step, instead of finishing it with
        # whatever ranks still answer; run() then reports the failure.
        def stop() -> bool:
            return cancelled() or self.group.failure() is not None

        return self.group.run(
            (spec, conditioning),
            lambda: self.denoiser.denoise(spec, conditioning, on_step, stop),
        )

    def close(self) -> None:
        self.group.close()


def serve_dit_node(args: argparse.Namespace, config: ParallelConfig, options: ModelOptions, layout: NodeLayout) -> None:
    """Node r > 0 of a multi-node DiT group: loads the same checkpoint with the same layout on its ranks and
    follows node 0, answering only health on --port; exits non-zero when the group ends under it."""
    spec, device, dtype = prepare_stage_process("dit", args)
    load_threads = 1 if args.disable_multithread_weight_load else args.num_weight_load_threads
    settings = layout.settings("dit", config.total_ranks, device.type, args.threads)
    payload = DitPayload(str(spec.path), dtype, config, options, load_threads)
    if layout.channel is None:
        raise ValueError("a follower node needs the control channel to node 0")
    try:
        credentials = server_credentials_from_args(args)
    except TLSConfigError as error:
        raise SystemExit(f"stagediff serve dit: {error}") from None
    serve_follower_node(
        settings, layout.channel, make_dit_worker, payload, host=args.host, port=args.port, credentials=credentials
    )
