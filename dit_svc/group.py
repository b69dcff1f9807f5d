"""The DiT stage as a process group (see services/rank_group/ for how the group runs).

The group may span several machines: node 0 is the stage (`DenoiserGroup`), every other node runs `serve_dit_node`,
which follows it. Every rank holds the family's denoiser (dit_svc/denoise.py make_denoiser) with the same parallel
layout; for each request rank 0 hands the embeddings to the followers and all ranks run the denoising loop in step.
At the start of each step rank 0 tells the group whether to go on (stagekit/parallel/cfg.py), so a cancelled request
stops every rank within a step. A family that makes sound (LTX-2) runs its joint video and audio loop the same way
(`denoise_av_request`), rank 0 answering with both latents. A request's LoRA adapters are read and checked on rank 0
before the group runs it (dit_svc/lora/cache.py `AdapterCache.check`): a bad adapter fails that request alone, while
an error on a rank inside the group would end the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from dit_svc.config import DenoiserBuild, DitConfig
from dit_svc.denoise import (
    denoise_av_request,
    denoise_batch_request,
    denoise_request,
    make_adapter_cache,
    make_denoiser,
)
from dit_svc.lora import AdapterCache
from dit_svc.step_cache import CachePasses
from services.rank_group import ONE_NODE, NodeLayout, RankGroup, serve_follower_node
from stagekit.denoise import Denoiser, DenoiseSpec, makes_audio, takes_images
from stagekit.errors import Cancelled, NotFoundError


@dataclass(frozen=True)
class DitPayload:
    model_dir: str
    dtype: torch.dtype
    build: DenoiserBuild
    # MagCache's calibrated ratios per expert (dit_svc/cache_offer.py), None when the stage offers no mag.
    mag_ratios: dict[str, list[float]] | None = None


@dataclass(frozen=True)
class BatchMessage:
    """Several requests the group denoises as one batch (dit_svc/batching.py)."""

    specs: list[DenoiseSpec]
    conditionings: list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class AudioVideoMessage:
    """One request of a family that makes sound (stagekit.denoise.AudioDenoiser: LTX-2), which the group runs
    through its joint video and audio loop (dit_svc/denoise.py `denoise_av_request`)."""

    spec: DenoiseSpec
    conditioning: dict[str, torch.Tensor]


class DitWorker:
    def __init__(
        self,
        denoiser: Denoiser,
        mag_ratios: dict[str, list[float]] | None = None,
        adapters: AdapterCache | None = None,
    ) -> None:
        self.denoiser = denoiser
        self.mag_ratios = mag_ratios
        self.adapters = adapters

    def handle(
        self, message: tuple[DenoiseSpec, dict[str, torch.Tensor]] | BatchMessage | AudioVideoMessage
    ) -> (
        tuple[torch.Tensor, CachePasses]
        | list[tuple[torch.Tensor | None, CachePasses]]
        | tuple[torch.Tensor, torch.Tensor, CachePasses]
    ):
        if isinstance(message, BatchMessage):
            # Rank 0's cancellations reach every rank inside the loop (members_still_wanted).
            everyone = [True] * len(message.specs)
            return denoise_batch_request(
                self.denoiser,
                message.specs,
                message.conditionings,
                lambda *step: None,
                lambda: everyone,
                adapters=self.adapters,
            )
        if isinstance(message, AudioVideoMessage):
            denoiser = self.denoiser
            assert makes_audio(denoiser), f"{type(denoiser).__name__} makes no sound"
            return denoise_av_request(
                denoiser,
                message.spec,
                message.conditioning,
                on_step=lambda step, total: None,
                cancelled=lambda: False,
                adapters=self.adapters,
            )
        spec, conditioning = message
        return denoise_request(
            self.denoiser,
            spec,
            conditioning,
            on_step=lambda step, total: None,
            cancelled=lambda: False,
            mag_ratios=self.mag_ratios,
            adapters=self.adapters,
        )


def make_dit_worker(rank: int, device: torch.device, payload: DitPayload) -> DitWorker:
    build = payload.build
    denoiser = make_denoiser(payload.model_dir, device, payload.dtype, build)
    return DitWorker(
        denoiser, payload.mag_ratios, make_adapter_cache(denoiser, build.options, load_threads=build.load_threads)
    )


def _progress(on_step: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """Rank 0's `on_step` in a group. A call cancelled while its progress goes out stops at the next step, where rank 0
    tells every rank to stop (stagekit.denoise.stop_if_cancelled): the stream's emit raises Cancelled then
    (services/stage.py), which on rank 0 alone would leave the other ranks waiting in that step's collectives."""

    def report(step: int, total: int) -> None:
        with contextlib.suppress(Cancelled):
            on_step(step, total)

    return report


class DenoiserGroup:
    """Rank 0's denoiser: same interface as the family's denoiser, with every rank of the group in step."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        threads: int,
        build: DenoiserBuild,
        *,
        layout: NodeLayout = ONE_NODE,
        mag_ratios: dict[str, list[float]] | None = None,
    ) -> None:
        settings = layout.settings("dit", build.parallel.total_ranks, device.type, threads)
        payload = DitPayload(str(model_dir), dtype, build, mag_ratios)
        self.group = RankGroup(settings, make_dit_worker, payload, layout.channel)
        self.denoiser: Denoiser = self.group.worker.denoiser
        self.mag_ratios = mag_ratios
        self.adapters: AdapterCache | None = self.group.worker.adapters

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
        denoiser = self.denoiser
        assert takes_images(denoiser), "asked only of a family that takes input images"
        return denoiser.image_tensor_shape(name, spec)

    def failure(self) -> str | None:
        return self.group.failure()

    def denoise_request(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, CachePasses]:
        """dit_svc.denoise.denoise_request on every rank of the group in step; rank 0's result."""

        # A group that lost a rank or a node stops the request at the next step, instead of finishing it with
        # whatever ranks still answer; run() then reports the failure.
        def stop() -> bool:
            return cancelled() or self.group.failure() is not None

        self._check_adapters(spec)
        return self.group.run(
            (spec, conditioning),
            lambda: denoise_request(
                self.denoiser,
                spec,
                conditioning,
                _progress(on_step),
                stop,
                mag_ratios=self.mag_ratios,
                adapters=self.adapters,
            ),
        )

    def denoise_av_request(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, torch.Tensor, CachePasses]:
        """dit_svc.denoise.denoise_av_request on every rank of the group in step, for a denoiser that makes sound
        (`stagekit.denoise.makes_audio`); rank 0's video latents, audio latents and passes."""
        denoiser = self.denoiser
        assert makes_audio(denoiser), f"{type(denoiser).__name__} makes no sound"

        # As denoise_request: a group that lost a rank or a node stops the request at the next step.
        def stop() -> bool:
            return cancelled() or self.group.failure() is not None

        self._check_adapters(spec)
        return self.group.run(
            AudioVideoMessage(spec, conditioning),
            lambda: denoise_av_request(denoiser, spec, conditioning, _progress(on_step), stop, adapters=self.adapters),
        )

    def _check_adapters(self, spec: DenoiseSpec) -> None:
        """Refuses a request whose adapters rank 0 cannot read and check, before any other rank sees it."""
        if spec.loras:
            if self.adapters is None:
                raise NotFoundError(
                    f"lora '{spec.loras[0][0]}': the DiT serves no adapters per request (no --lora-dir)"
                )
            self.adapters.check(spec.loras)

    def denoise_batch_request(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[tuple[torch.Tensor | None, CachePasses]]:
        """dit_svc.denoise.denoise_batch_request on every rank of the group in step; rank 0's result."""

        # A group that lost a rank or a node drops every member at the next step; run() reports the failure.
        def still_wanted() -> list[bool]:
            failed = self.group.failure() is not None
            return [keep and not failed for keep in wanted()]

        self._check_adapters(specs[0])
        return self.group.run(
            BatchMessage(specs, conditionings),
            lambda: denoise_batch_request(
                self.denoiser, specs, conditionings, on_step, still_wanted, adapters=self.adapters
            ),
        )

    def close(self) -> None:
        self.group.close()


def serve_dit_node(
    config: DitConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    drain_grace_s: float,
) -> None:
    """Node r > 0 of a multi-node DiT group: loads the same checkpoint with the same layout on its ranks and
    follows node 0, answering only health on `host`:`port`; exits non-zero when the group ends under it. On
    SIGTERM its ranks stay for node 0's calls in flight, up to `drain_grace_s`."""
    layout = config.layout
    settings = layout.settings("dit", config.parallel.total_ranks, device.type, config.threads)
    payload = DitPayload(str(model_dir), dtype, config.build, config.step_cache.mag_ratios)
    if layout.channel is None:
        raise ValueError("a follower node needs the control channel to node 0")
    serve_follower_node(
        settings,
        layout.channel,
        make_dit_worker,
        payload,
        host=host,
        port=port,
        credentials=credentials,
        drain_grace_s=drain_grace_s,
    )
