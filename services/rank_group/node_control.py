"""The control channel of a group over several machines ("nodes").

In torchrun's static-rendezvous vocabulary: `nnodes` nodes of world_size / nnodes ranks each, laid out
node-major (node r holds global ranks r*L .. r*L+L-1), torch.distributed's TCP store on node 0 at
master_addr:master_port. Node 0 is the stage itself (`RankGroup`, rank 0 leads; `accept_nodes` waits for the
others). Every other node runs `FollowerNode`: it connects to node 0's control channel (`connect_to_node0`: a
`multiprocessing.connection` listener on the group port, authenticated with a key derived from the cluster
secret, since its messages are pickles), spawns its own ranks, hands them each message node 0 sends and sends
their replies back. Messages and replies are the same tuples the local queues carry, pickled with plain
pickle: the queues' pickler would pass tensors as shared memory, which does not cross machines.

A follower node whose group ends (node 0 gone, one of its ranks dead) exits non-zero
(`serve_follower_node`), so that whatever runs the containers restarts it and it joins the next group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import grpc

from services.rank_group.local import dead_follower, spawn_followers, stop_followers
from services.rank_group.settings import (
    STARTUP_TIMEOUT_S,
    ControlChannel,
    GroupFailure,
    GroupSettings,
    WorkerFactory,
)
from services.server import DEFAULT_GRACE_SECONDS, serve

logger = logging.getLogger(__name__)

# A node that stops answering (its machine gone, the network cut) is found by TCP keepalive within ~25 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


# The control channel. `Connection.send` pickles with multiprocessing's pickler, in which torch passes
# tensors as shared-memory handles that only the same machine can open; plain pickle copies their bytes.
def send_message(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _keepalive(conn: Connection) -> None:
    """Lets the kernel notice a peer that vanished without closing the connection (a machine lost)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def accept_nodes(settings: GroupSettings, channel: ControlChannel, timeout: float) -> dict[int, Connection]:
    """Node 0: waits until every other node has connected and said hello; returns their connections by node.

    A peer without the key fails multiprocessing's challenge and is dropped; a hello
    for a node rank out of range or another world size is refused with the reason.
    """
    listener = Listener((channel.bind_host, channel.port), authkey=channel.authkey, backlog=settings.nnodes)
    logger.info("%s: waiting for nodes 1..%d on port %d", settings.name, settings.nnodes - 1, channel.port)
    nodes: dict[int, Connection] = {}
    all_connected, closing = threading.Event(), threading.Event()

    def accept() -> None:
        while len(nodes) < settings.nnodes - 1:
            conn = None
            try:
                conn = listener.accept()
                if not conn.poll(30):
                    raise EOFError("no hello within 30 s")
                kind, node, world_size = receive_message(conn)
            except Exception as error:  # a stranger, a wrong key, a peer that went away: keep waiting
                if closing.is_set():
                    return
                logger.warning("%s: refused a connection to the group port: %s", settings.name, error)
                if conn is not None:
                    conn.close()
                continue
            refusal = None
            if kind != "hello" or not 1 <= node < settings.nnodes:
                refusal = f"--node-rank {node}: allowed 1..{settings.nnodes - 1} with --nnodes {settings.nnodes}"
            elif world_size != settings.world_size:
                refusal = f"world size {world_size} differs from node 0's {settings.world_size}: use the same flags"
            if refusal is not None:
                logger.warning("%s: refused node %s: %s", settings.name, node, refusal)
                with contextlib.suppress(OSError):
                    send_message(conn, ("refused", refusal))
                conn.close()
                continue
            try:
                send_message(conn, ("welcome", None))
                _keepalive(conn)
            except OSError as error:
                logger.warning("%s: node %d went away while joining: %s", settings.name, node, error)
                continue
            if node in nodes:  # the node restarted before the group formed: its old connection is dead
                logger.warning("%s: node %d connected again; dropping its earlier connection", settings.name, node)
                nodes[node].close()
            nodes[node] = conn
            logger.info("%s: node %d connected (%d of %d)", settings.name, node, len(nodes), settings.nnodes - 1)
        all_connected.set()

    threading.Thread(target=accept, name=f"{settings.name}-accept", daemon=True).start()
    connected = all_connected.wait(timeout)
    closing.set()
    listener.close()
    if not connected:
        missing = sorted(set(range(1, settings.nnodes)) - set(nodes))
        raise GroupFailure(
            f"{settings.name}: nodes {missing} did not connect to port {channel.port} within {timeout:.0f} s "
            "(started with the same flags, --node-rank, --master-addr of node 0 and the same cluster secret?)"
        )
    return nodes


def connect_to_node0(settings: GroupSettings, channel: ControlChannel, timeout: float) -> Connection:
    """Node r > 0: connects to node 0's control channel, retrying while node 0 is not up yet (pods start in any
    order), and says hello; raises GroupFailure when refused or when node 0 stays unreachable."""
    address = (settings.master_addr, channel.port)
    where = f"node 0 at {settings.master_addr}:{channel.port}"
    deadline = time.monotonic() + timeout
    logged = False
    while True:
        try:
            conn = Client(address, authkey=channel.authkey)
            break
        except multiprocessing.AuthenticationError:
            raise GroupFailure(
                f"{where} refused this node's key: every node needs the same cluster secret "
                "(--cluster-secret-file or $STAGEDIFF_CLUSTER_SECRET)"
            ) from None
        except OSError as error:  # refused, unreachable, or the name not resolvable yet
            if time.monotonic() > deadline:
                raise GroupFailure(f"could not reach {where} within {timeout:.0f} s: {error}") from None
            if not logged:
                logger.info("%s: waiting for %s (%s)", settings.name, where, error)
                logged = True
            time.sleep(1.0)
    send_message(conn, ("hello", settings.node_rank, settings.world_size))
    if not conn.poll(timeout):
        raise GroupFailure(f"{where} did not answer this node's hello within {timeout:.0f} s")
    kind, detail = receive_message(conn)
    if kind != "welcome":
        raise GroupFailure(f"{where} refused node {settings.node_rank}: {detail}")
    _keepalive(conn)
    logger.info("%s: node %d joined %s", settings.name, settings.node_rank, where)
    return conn


class FollowerNode:
    """Node r > 0 of a multi-node group: its ranks follow node 0's rank 0, relayed over the control channel.

    Two threads relay: one hands node 0's messages to every local rank, one sends
    the ranks' replies back. When the group ends under this node (node 0 stopped
    it or went away, or a local rank died), `ended` says why and `on_end` is
    called once, unless `close` was called first.
    """

    def __init__(
        self,
        settings: GroupSettings,
        channel: ControlChannel,
        factory: WorkerFactory,
        payload: Any,
        on_end: Callable[[str], None] = lambda reason: None,
        timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.on_end = on_end
        self.ended: str | None = None
        self._stopped_by_node0: str | None = None
        self._closing = False
        self._ready: set[int] = set()
        self._all_ready = threading.Event()
        self.conn = connect_to_node0(settings, channel, timeout)
        self.replies, self.inboxes, self.followers = spawn_followers(settings, settings.local_ranks, factory, payload)
        threading.Thread(target=self._hand_messages, name=f"{settings.name}-messages", daemon=True).start()
        threading.Thread(target=self._send_replies, name=f"{settings.name}-replies", daemon=True).start()

    def failure(self) -> str | None:
        """Why this node's part of the group cannot go on, or None."""
        return self._stopped_by_node0 or dead_follower(self.settings.name, self.followers)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Blocks until every local rank has loaded and joined the group; raises GroupFailure if the group ends."""
        deadline = time.monotonic() + timeout
        while not self._all_ready.wait(0.2):
            if (reason := self.ended or self.failure()) is not None:
                raise GroupFailure(reason)
            if time.monotonic() > deadline:
                raise GroupFailure(f"{self.settings.name}: local ranks not ready within {timeout:.0f} s")

    def _hand_messages(self) -> None:
        where = f"node 0 ({self.settings.master_addr})"
        try:
            while (message := receive_message(self.conn)) is not None:
                for inbox in self.inboxes.values():
                    inbox.put(message)
            self._stopped_by_node0 = f"{where} stopped the group"
        except Exception as error:  # EOFError or OSError once the connection is gone
            self._stopped_by_node0 = f"lost the connection to {where} ({type(error).__name__})"

    def _send_replies(self) -> None:
        """Forwards every reply to node 0 until the group ends, then tells node 0 why (if it still listens)."""
        while True:
            try:
                reply = self.replies.get(timeout=0.2)
            except queue.Empty:
                if (reason := self.failure()) is not None:
                    break
                continue
            if reply[1] == "ready":
                self._ready.add(reply[0])
                if len(self._ready) == len(self.followers):
                    self._all_ready.set()
            try:
                send_message(self.conn, reply)
            except OSError as error:
                reason = f"lost the connection to node 0 ({error})"
                break
        if self._closing:
            return
        self.ended = reason
        logger.error("%s node %d: the group ended: %s", self.settings.name, self.settings.node_rank, reason)
        with contextlib.suppress(OSError):
            send_message(self.conn, (None, "failed", reason))
        self.on_end(reason)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self.conn.close()
        # Once the group has ended, ranks wait in collectives that will never complete: do not wait for them.
        stop_followers(self.inboxes, self.followers, wait_s=5 if self.ended is None else 0)


async def _in_daemon_thread(fn: Callable[[], None]) -> None:
    """Awaits blocking `fn` run in a daemon thread: unlike asyncio.to_thread's, such a thread does not keep the
    process alive after SIGTERM while `fn` still waits (for node 0 to come up, for the group to form)."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if finished.done():  # cancelled: serve() stopped waiting
            return
        if error is None:
            finished.set_result(None)
        else:
            finished.set_exception(error)

    def run() -> None:
        try:
            fn()
            outcome = None
        except BaseException as error:
            outcome = error
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name="node-load", daemon=True).start()
    await finished


def serve_follower_node(
    settings: GroupSettings,
    channel: ControlChannel,
    factory: WorkerFactory,
    payload: Any,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    drain_grace_s: float = DEFAULT_GRACE_SECONDS,
) -> None:
    """Runs node r > 0 until SIGTERM, or until its group ends (then raises SystemExit, non-zero, to be restarted).

    It does not serve the stage's API (node 0 does), only grpc.health.v1 on `port`:
    NOT_SERVING until its ranks are ready, SERVING while they are, NOT_SERVING as it
    drains, so Kubernetes' gRPC probes work on every node. With `credentials` (the
    stage's --tls-cert) it answers over TLS, as node 0 does, so one probe fits every node.
    Its ranks take part in node 0's calls, so on SIGTERM they stay until node 0 ends the group (having drained
    its own calls) or `drain_grace_s` runs out, whichever comes first.
    """
    name = f"{settings.name} node {settings.node_rank}"
    nodes: list[FollowerNode] = []
    group_ended = threading.Event()

    def stop_serving(reason: str) -> None:
        # The group cannot come back without node 0: drain and exit, as SIGTERM would have us do.
        group_ended.set()
        os.kill(os.getpid(), signal.SIGTERM)

    async def drain() -> None:
        if nodes:
            await asyncio.to_thread(group_ended.wait, drain_grace_s)

    def start() -> None:
        nodes.append(FollowerNode(settings, channel, factory, payload, on_end=stop_serving))
        nodes[0].wait_ready()

    async def load() -> None:
        await _in_daemon_thread(start)

    async def shutdown() -> None:
        for node in nodes:
            node.close()

    try:
        asyncio.run(
            serve(
                name=name,
                host=host,
                port=port,
                register=lambda server: [],
                load=load,
                on_shutdown=shutdown,
                on_drain=drain,
                credentials=credentials,
            )
        )
    except GroupFailure as error:
        raise SystemExit(f"{name}: {error}") from None
    finally:
        for node in nodes:
            node.close()
    if nodes and nodes[0].ended is not None:
        raise SystemExit(f"{name}: the group ended ({nodes[0].ended}); exiting to be restarted")
