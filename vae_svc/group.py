"""The VAE stage as a patch-parallel process group (see services/rank_group/).

Every rank holds the VAE, with the decoder the checkpoint's family names (the
streaming causal Wan decoder, or an image family's: Qwen-Image's, FLUX.1's, which
Z-Image shares, or FLUX.2 klein's, an image being one latent frame);
each request is a decode session on every rank, keyed by a session id, and each
latent frame is one unit of group work: rank 0 hands the frame to the followers,
every rank decodes its band of rows (exchanging halo rows with its neighbours),
and the bands are gathered on rank 0, which streams the frames. Frames of
different requests may interleave; each session keeps its own causal caches, and
rank 0 issues the work units one at a time, in the same order on every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.rank_group import GroupSettings, RankGroup, free_port
from stagekit.decode import LatentDecoder

if TYPE_CHECKING:
    from vae_svc.patch_parallel import PatchParallelDecodeSession

OUTPUT_RANK = 0


@dataclass(frozen=True)
class VaePayload:
    model_dir: str
    dtype: torch.dtype
    decoder_class: type[LatentDecoder]  # the family's (services.checkpoint: traits.load("decoder"))


class VaeWorker:
    """Decode sessions of one rank, by session id."""

    def __init__(self, decoder: LatentDecoder) -> None:
        self.decoder = decoder
        self.sessions: dict[int, PatchParallelDecodeSession] = {}

    def handle(self, message: tuple[Any, ...]) -> torch.Tensor | None:
        kind, session_id, *rest = message
        if kind == "start":
            from vae_svc.patch_parallel import PatchParallelDecodeSession  # diffusers' decoders: patch-parallel only

            self.sessions[session_id] = PatchParallelDecodeSession(self.decoder, output_rank=OUTPUT_RANK)
            return None
        if kind == "frame":
            return self.sessions[session_id].decode_next(rest[0])
        self.sessions.pop(session_id, None)  # "end"
        return None


def make_vae_worker(rank: int, device: torch.device, payload: VaePayload) -> VaeWorker:
    return VaeWorker(payload.decoder_class(payload.model_dir, device, payload.dtype))


class PatchParallelDecoder:
    """Rank 0's decoder: sessions decode on every rank of the group."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        threads: int,
        size: int,
        *,
        decoder_class: type[LatentDecoder],
    ) -> None:
        """A group of `size` ranks, each loading `decoder_class` (the checkpoint's family's) from `model_dir`."""
        settings = GroupSettings("vae", size, device.type, threads, free_port())
        self.group = RankGroup(settings, make_vae_worker, VaePayload(str(model_dir), dtype, decoder_class))
        self.size = size
        self._session_ids = itertools.count()

    @property
    def worker(self) -> VaeWorker:
        return self.group.worker

    @property
    def vae(self) -> torch.nn.Module:
        return self.worker.decoder.vae

    @property
    def latent_channels(self) -> int:
        return self.worker.decoder.latent_channels

    def failure(self) -> str | None:
        return self.group.failure()

    def session(self) -> GroupDecodeSession:
        return GroupDecodeSession(self, next(self._session_ids))

    def _run(self, message: tuple[Any, ...]) -> torch.Tensor | None:
        return self.group.run(message, lambda: self.worker.handle(message))

    def close(self) -> None:
        self.group.close()


class GroupDecodeSession:
    """Same interface as DecodeSession; call `close` when the request ends, however it ends."""

    def __init__(self, owner: PatchParallelDecoder, session_id: int) -> None:
        self.owner = owner
        self.session_id = session_id
        self.frames_decoded = 0
        self.started = False

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self.owner._run(("start", self.session_id))
            self.started = True
        frames = self.owner._run(("frame", self.session_id, latent_frame))
        assert frames is not None  # rank 0 answers a frame with its decoded frames
        self.frames_decoded += frames.shape[0]
        return frames

    def close(self) -> None:
        if self.started and self.owner.failure() is None:
            self.owner._run(("end", self.session_id))
