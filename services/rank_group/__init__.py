"""A stage's process group: rank 0 serves gRPC, the other ranks follow it, on one machine or several.

A stage with a parallel layout (the DiT's sequence/tensor/CFG parallelism, the VAE's patch parallelism) starts
its other ranks itself, with the spawn method: a fresh interpreter each, so nothing of rank 0's gRPC state is
inherited. Each rank builds the same `RankWorker` (load the model, apply the layout). Work reaches the
followers over a multiprocessing queue rather than a collective, so an idle group is not a collective waiting
to time out; then every rank runs the same computation in step, with collectives inside it, and rank 0 alone
answers.

- settings.py: the group's settings and layout over nodes, and `GroupFailure`.
- local.py: this node's ranks (joining torch.distributed, the follower rank processes).
- leader.py: `RankGroup`, rank 0's view of the whole group.
- node_control.py: the control channel between nodes, and the follower nodes.

A follower that dies, or a node whose connection closes, leaves the group unable to compute: `failure()` says
so, the stage's health turns NOT_SERVING, and calls fail with UNAVAILABLE instead of hanging.
"""

from __future__ import annotations

from services.rank_group.leader import RankGroup
from services.rank_group.local import follower_main, join_group
from services.rank_group.node_control import FollowerNode, accept_nodes, connect_to_node0, serve_follower_node
from services.rank_group.settings import (
    COLLECTIVE_TIMEOUT,
    ONE_NODE,
    STARTUP_TIMEOUT_S,
    ControlChannel,
    GroupFailure,
    GroupSettings,
    NodeLayout,
    RankWorker,
    WorkerFactory,
    free_port,
    group_authkey,
)

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "ONE_NODE",
    "STARTUP_TIMEOUT_S",
    "ControlChannel",
    "FollowerNode",
    "GroupFailure",
    "GroupSettings",
    "NodeLayout",
    "RankGroup",
    "RankWorker",
    "WorkerFactory",
    "accept_nodes",
    "connect_to_node0",
    "follower_main",
    "free_port",
    "group_authkey",
    "join_group",
    "serve_follower_node",
]
