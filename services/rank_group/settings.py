"""What a rank group is made of: its settings, where its ranks live (`NodeLayout`), node 0's control channel
address, and the error a group that can no longer compute raises."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

# A single collective never takes this long when every rank is alive; a dead
# peer usually fails the collective at once, this bounds the other cases.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 600.0


class RankWorker(Protocol):
    """What every rank runs for each message; collectives inside keep the ranks in step."""

    def handle(self, message: Any) -> Any: ...


# Builds a rank's worker: (rank, device, payload) -> RankWorker. Must be a module-level
# function, since follower ranks import it by name.
WorkerFactory = Callable[[int, torch.device, Any], RankWorker]


@dataclass(frozen=True)
class GroupSettings:
    name: str  # the stage, for log lines and errors
    world_size: int
    device: str  # "cpu" or "cuda": each rank takes cuda:<local rank> on accelerators
    threads: int
    master_port: int
    master_addr: str = "127.0.0.1"
    nnodes: int = 1
    node_rank: int = 0

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs (node-major, as torchrun lays them out)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


@dataclass(frozen=True)
class ControlChannel:
    """Node 0's listener for the other nodes: it binds `bind_host:port` (the stage's --host, loopback unless
    told otherwise); they connect to master_addr:port."""

    port: int
    authkey: bytes = field(repr=False)
    bind_host: str = "127.0.0.1"


@dataclass(frozen=True)
class NodeLayout:
    """Where a group's ranks live; the default is today's single machine on a free local port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    channel: ControlChannel | None = None  # required with nnodes > 1

    def settings(self, name: str, world_size: int, device: str, threads: int) -> GroupSettings:
        port = self.master_port if self.master_port is not None else free_port()
        return GroupSettings(name, world_size, device, threads, port, self.master_addr, self.nnodes, self.node_rank)


ONE_NODE = NodeLayout()


class GroupFailure(RuntimeError):
    """The group lost a rank or a rank failed; the stage cannot compute any more."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def group_authkey(secret: str) -> bytes:
    """The control channel's key: derived from the cluster secret, so the secret itself never serves as one."""
    return hashlib.sha256(b"stagediff rank group control channel\0" + secret.encode()).digest()
