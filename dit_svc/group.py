"""The DiT stage's process group: rank 0 serves gRPC, the other ranks follow it.

`stagediff serve dit` with a parallel layout starts the other ranks itself,
with the spawn method (a fresh interpreter each, so nothing of rank 0's gRPC
state is inherited). Requests reach the followers over a multiprocessing queue
rather than a collective, so an idle group is not a collective waiting to time
out; inside a request every rank runs the same denoising loop in step, and rank
0 alone streams the result. Each step starts with rank 0 telling the group
whether to go on, so a cancelled request stops every rank within one step.

A follower that dies leaves the group unable to compute: `failure()` says so,
and the stage turns NOT_SERVING instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dit_svc.denoise import DenoiseSpec, WanDenoiser
from dit_svc.parallel import ParallelConfig
from services.stage import Cancelled

logger = logging.getLogger(__name__)

# A single collective never takes this long when every rank is alive; a dead
# peer usually fails the collective at once, this bounds the other cases.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GroupSettings:
    model_dir: str
    device: str  # "cpu" or "cuda": each rank takes cuda:<rank> on accelerators
    dtype: torch.dtype
    threads: int
    config: ParallelConfig
    master_port: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join_group(rank: int, settings: GroupSettings) -> torch.device:
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    if settings.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{settings.master_port}",
        rank=rank,
        world_size=settings.config.total_ranks,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return device


def follower_main(rank: int, settings: GroupSettings, requests, replies) -> None:
    """A follower rank: load, parallelize, then run every request rank 0 hands over until told to stop."""
    try:
        device = _join_group(rank, settings)
        denoiser = WanDenoiser(settings.model_dir, device, settings.dtype, parallel=settings.config)
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    replies.put((rank, "ready", None))
    while (message := requests.get()) is not None:
        spec, prompt_embeds, negative_prompt_embeds = message
        try:
            denoiser.denoise(spec, prompt_embeds, negative_prompt_embeds, on_step=_ignore, cancelled=_never)
            replies.put((rank, "done", None))
        except Cancelled:
            replies.put((rank, "cancelled", None))
        except BaseException:
            # Leave the group: rank 0's pending collectives then fail at once instead of timing out.
            replies.put((rank, "error", traceback.format_exc()))
            return
    dist.destroy_process_group()


def _ignore(step: int, total: int) -> None:
    pass


def _never() -> bool:
    return False


class DenoiserGroup:
    """Rank 0's view of the group; it denoises like a WanDenoiser, with every rank in step."""

    def __init__(self, settings: GroupSettings) -> None:
        self.settings = settings
        context = multiprocessing.get_context("spawn")
        self.replies = context.Queue()
        self.requests = [context.Queue() for _ in range(1, settings.config.total_ranks)]
        self.followers = [
            context.Process(
                target=follower_main, args=(rank, settings, self.requests[rank - 1], self.replies), daemon=True
            )
            for rank in range(1, settings.config.total_ranks)
        ]
        for process in self.followers:
            process.start()
        logger.info("dit: started ranks 1..%d (pids %s)", len(self.followers), [p.pid for p in self.followers])
        device = _join_group(0, settings)
        self.denoiser = WanDenoiser(settings.model_dir, device, settings.dtype, parallel=settings.config)
        self._await_replies("ready", STARTUP_TIMEOUT_S)
        logger.info("dit: group of %d ranks ready: %s", settings.config.total_ranks, settings.config.describe())

    @property
    def transformer(self) -> torch.nn.Module:
        return self.denoiser.transformer

    @property
    def text_dim(self) -> int:
        return self.denoiser.text_dim

    def failure(self) -> str | None:
        """Why the group can no longer compute, or None while every follower lives."""
        for rank, process in enumerate(self.followers, start=1):
            if process.exitcode is not None:
                return f"dit rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def denoise(
        self,
        spec: DenoiseSpec,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        if (reason := self.failure()) is not None:
            raise GroupFailure(reason)
        for requests in self.requests:
            requests.put((spec, prompt_embeds, negative_prompt_embeds))
        try:
            latents = self.denoiser.denoise(spec, prompt_embeds, negative_prompt_embeds, on_step, cancelled)
        except Cancelled:
            self._await_replies("cancelled", COLLECTIVE_TIMEOUT.total_seconds())
            raise
        except Exception as error:
            reason = self.failure()
            raise GroupFailure(reason or f"dit rank 0 failed: {error}") from error
        self._await_replies("done", COLLECTIVE_TIMEOUT.total_seconds())
        return latents

    def _await_replies(self, expected: str, timeout: float) -> None:
        """Waits for every follower's reply, failing fast when one dies or reports an error."""
        waiting = set(range(1, self.settings.config.total_ranks))
        deadline = time.monotonic() + timeout
        while waiting:
            if (reason := self.failure()) is not None:
                raise GroupFailure(reason)
            if time.monotonic() > deadline:
                raise GroupFailure(f"dit ranks {sorted(waiting)} did not answer within {timeout:.0f} s")
            try:
                rank, status, detail = self.replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if status == "error":
                raise GroupFailure(f"dit rank {rank} failed:\n{detail}")
            if status not in (expected, "cancelled", "done"):
                raise GroupFailure(f"dit rank {rank} answered {status}, expected {expected}")
            waiting.discard(rank)

    def close(self) -> None:
        for requests in self.requests:
            requests.put(None)
        for process in self.followers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class GroupFailure(RuntimeError):
    """The group lost a rank or a rank failed; the stage cannot compute any more."""


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (sharded DTensor parameters count their local shard)."""
    total = 0
    for parameter in module.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total
