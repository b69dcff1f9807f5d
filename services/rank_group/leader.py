"""Rank 0's side of a group: it hands each message to every other rank (its own node's followers through
their queues, other nodes' through the control channel), runs its own part meanwhile, and waits for every
reply; the first failure found (a dead follower, a lost node) fails every later call."""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from services.rank_group.local import dead_follower, join_group, spawn_followers, stop_followers
from services.rank_group.node_control import accept_nodes, receive_message, send_message
from services.rank_group.settings import (
    COLLECTIVE_TIMEOUT,
    STARTUP_TIMEOUT_S,
    ControlChannel,
    GroupFailure,
    GroupSettings,
    RankWorker,
)
from stagekit.errors import Cancelled

logger = logging.getLogger(__name__)

# How long rank 0 waits, after its own part failed, for the reason (a dead rank, a lost node) to show.
FAILURE_GRACE_S = 2.0
T = TypeVar("T")
WorkerT = TypeVar("WorkerT", bound=RankWorker)


class RankGroup(Generic[WorkerT]):
    """Rank 0's view of the group: its local followers and, in a multi-node group, the other nodes.

    Generic in the worker that the stage's factory builds, which rank 0 also runs (`worker`)."""

    def __init__(
        self,
        settings: GroupSettings,
        factory: Callable[[int, torch.device, Any], WorkerT],
        payload: Any,
        channel: ControlChannel | None = None,
    ) -> None:
        self.settings = settings
        self.remotes: dict[int, Connection] = {}
        self._lost: dict[int, str] = {}  # node -> why its connection ended
        self._failure: str | None = None
        self._closing = False
        if settings.nnodes > 1:
            if channel is None:
                raise ValueError("a group over several nodes needs a control channel")
            self.remotes = accept_nodes(settings, channel, STARTUP_TIMEOUT_S)
        self.replies, self.inboxes, self.followers = spawn_followers(
            settings, settings.local_ranks[1:], factory, payload
        )
        for node, conn in self.remotes.items():
            threading.Thread(
                target=self._listen, args=(node, conn), name=f"{settings.name}-node{node}", daemon=True
            ).start()
        self.device = join_group(0, settings)
        self.worker: WorkerT = factory(0, self.device, payload)
        self._await_replies(STARTUP_TIMEOUT_S)
        logger.info("%s: group of %d ranks on %d node(s) ready", settings.name, settings.world_size, settings.nnodes)

    def _listen(self, node: int, conn: Connection) -> None:
        """Puts a node's replies with the local ones; records why the node's connection ended."""
        try:
            while True:
                rank, status, detail = receive_message(conn)
                if rank is None:  # the node's last word: why its part of the group ended
                    self._lost.setdefault(node, f"{self.settings.name} node {node} failed: {detail}")
                    return
                self.replies.put((rank, status, detail))
        except Exception as error:  # EOFError or OSError when the connection closes
            if not self._closing:
                self._lost.setdefault(
                    node, f"{self.settings.name} node {node} lost: its connection closed ({type(error).__name__})"
                )

    def failure(self) -> str | None:
        """Why the group can no longer compute, or None while every follower and node lives.

        The first reason found stays the answer, so the log and every refused call name the same cause. A lost
        node comes first: its closed connection shows at once, while the local ranks it takes down with it
        (their collectives fail) exit a moment later.
        """
        if self._failure is None:
            lost = next((self._lost[node] for node in sorted(self._lost)), None)
            self._failure = lost or dead_follower(self.settings.name, self.followers)
        return self._failure

    def run(self, message: Any, lead: Callable[[], T]) -> T:
        """Hands `message` to every follower and runs `lead` (rank 0's part of the same work) meanwhile."""
        if (reason := self.failure()) is not None:
            raise GroupFailure(reason)
        if self.remotes:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            for node, conn in self.remotes.items():
                try:
                    conn.send_bytes(data)
                except OSError as error:
                    raise GroupFailure(self.failure() or f"{self.settings.name} node {node}: {error}") from error
        for inbox in self.inboxes.values():
            inbox.put(message)
        try:
            result = lead()
        except Cancelled:
            self._await_replies(COLLECTIVE_TIMEOUT.total_seconds())
            raise
        except Exception as error:
            raise GroupFailure(self._failure_soon() or f"{self.settings.name} rank 0 failed: {error}") from error
        self._await_replies(COLLECTIVE_TIMEOUT.total_seconds())
        return result

    def _failure_soon(self) -> str | None:
        """The group's failure, allowing a moment for it to show: a lost peer fails rank 0's collective at
        once, while its process exit or closed connection is noticed a little later."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while (reason := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return reason

    def _await_replies(self, timeout: float) -> None:
        """Waits for every follower's reply, failing fast when one dies or reports an error."""
        waiting = set(range(1, self.settings.world_size))
        deadline = time.monotonic() + timeout
        while waiting:
            if (reason := self.failure()) is not None:
                raise GroupFailure(reason)
            if time.monotonic() > deadline:
                late = sorted(waiting)
                raise GroupFailure(f"{self.settings.name} ranks {late} did not answer within {timeout:.0f} s")
            try:
                rank, status, detail = self.replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if status == "error":
                raise GroupFailure(f"{self.settings.name} rank {rank} failed:\n{detail}")
            waiting.discard(rank)

    def close(self) -> None:
        self._closing = True
        for conn in self.remotes.values():
            with contextlib.suppress(OSError):
                send_message(conn, None)
                conn.close()
        stop_followers(self.inboxes, self.followers, wait_s=10)
        if dist.is_initialized():
            dist.destroy_process_group()
