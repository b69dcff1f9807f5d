"""A stage's process group: rank 0 serves gRPC, the other ranks follow it, on one machine or several.

A stage with a parallel layout (the DiT's sequence/tensor/CFG parallelism, the
VAE's patch parallelism) starts its other ranks itself, with the spawn method:
a fresh interpreter each, so nothing of rank 0's gRPC state is inherited. Each
rank builds the same `RankWorker` (load the model, apply the layout). Work
reaches the followers over a multiprocessing queue rather than a collective, so
an idle group is not a collective waiting to time out; then every rank runs the
same computation in step, with collectives inside it, and rank 0 alone answers.

A group may span several machines ("nodes"), in torchrun's static-rendezvous
vocabulary: `nnodes` nodes of world_size / nnodes ranks each, laid out
node-major (node r holds global ranks r*L .. r*L+L-1), torch.distributed's TCP
store on node 0 at master_addr:master_port. Node 0 is the stage itself
(`RankGroup`, rank 0 leads). Every other node runs `FollowerNode`: it connects
to node 0's control channel (a `multiprocessing.connection` listener on the
group port, authenticated with a key derived from the cluster secret, since
its messages are pickles), spawns its own ranks, hands them each message node 0
sends and sends their replies back. Messages and replies are the same tuples the
local queues carry, pickled with plain pickle: the queues' pickler would pass
tensors as shared memory, which does not cross machines.

A follower that dies, or a node whose connection closes, leaves the group unable
to compute: `failure()` says so, the stage's health turns NOT_SERVING, and calls
fail with UNAVAILABLE instead of hanging. A follower node whose group ends
(node 0 gone, one of its ranks dead) exits non-zero, so that whatever runs the
containers restarts it and it joins the next group.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol, TypeVar

import grpc
import torch
import torch.distributed as dist

from services.server import serve
from services.stage import Cancelled

logger = logging.getLogger(__name__)

# A single collective never takes this long when every rank is alive; a dead
# peer usually fails the collective at once, this bounds the other cases.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 600.0
# How long rank 0 waits, after its own part failed, for the reason (a dead rank, a lost node) to show.
FAILURE_GRACE_S = 2.0
# A node that stops answering (its machine gone, the network cut) is found by TCP keepalive within ~25 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
T = TypeVar("T")


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
        return sock.getsockname()[1]


def group_authkey(secret: str) -> bytes:
    """The control channel's key: derived from the cluster secret, so the secret itself never serves as one."""
    return hashlib.sha256(b"stagediff rank group control channel\0" + secret.encode()).digest()


def join_group(rank: int, settings: GroupSettings) -> torch.device:
    """Initialises torch.distributed for this rank: NCCL on GPUs, gloo on the CPU."""
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    if settings.device == "cuda":
        device = torch.device("cuda", (rank % settings.ranks_per_node) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    host = f"[{settings.master_addr}]" if ":" in settings.master_addr else settings.master_addr
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{settings.master_port}",
        rank=rank,
        world_size=settings.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return device


def _next_message(inbox, parent: int) -> Any:
    """The next message, or None (stop) once the process that started this rank is gone: killed without a
    chance to say stop, it leaves the rank nobody to follow."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def follower_main(rank: int, settings: GroupSettings, factory: WorkerFactory, payload: Any, inbox, replies) -> None:
    """A follower rank: build the worker, then handle every message rank 0 hands over until told to stop."""
    parent = os.getppid()
    try:
        device = join_group(rank, settings)
        worker = factory(rank, device, payload)
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    replies.put((rank, "ready", None))
    while (message := _next_message(inbox, parent)) is not None:
        try:
            worker.handle(message)
            replies.put((rank, "done", None))
        except Cancelled:
            replies.put((rank, "cancelled", None))
        except BaseException:
            # Leave the group: rank 0's pending collectives then fail at once instead of timing out.
            replies.put((rank, "error", traceback.format_exc()))
            return
    dist.destroy_process_group()


def _spawn_followers(
    settings: GroupSettings, ranks: range, factory: WorkerFactory, payload: Any
) -> tuple[Any, dict[int, Any], dict[int, multiprocessing.Process]]:
    """Starts `ranks` as follower processes: (their shared replies queue, an inbox per rank, the processes)."""
    context = multiprocessing.get_context("spawn")
    replies = context.Queue()
    inboxes = {rank: context.Queue() for rank in ranks}
    followers = {
        rank: context.Process(
            target=follower_main, args=(rank, settings, factory, payload, inboxes[rank], replies), daemon=True
        )
        for rank in ranks
    }
    for process in followers.values():
        process.start()
    if followers:
        pids = [process.pid for process in followers.values()]
        logger.info("%s: started ranks %d..%d (pids %s)", settings.name, ranks[0], ranks[-1], pids)
    return replies, inboxes, followers


def _dead_follower(name: str, followers: dict[int, multiprocessing.Process]) -> str | None:
    for rank, process in followers.items():
        if process.exitcode is not None:
            return f"{name} rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
    return None


def _stop_followers(inboxes: dict[int, Any], followers: dict[int, multiprocessing.Process], wait_s: float) -> None:
    """Tells every follower to stop, gives them `wait_s` in all to leave the group, then kills the rest."""
    for inbox in inboxes.values():
        inbox.put(None)
    deadline = time.monotonic() + wait_s
    for process in followers.values():
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()


# The control channel. `Connection.send` pickles with multiprocessing's pickler, in which torch passes
# tensors as shared-memory handles that only the same machine can open; plain pickle copies their bytes.
def _send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> Any:
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
                kind, node, world_size = _receive(conn)
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
                    _send(conn, ("refused", refusal))
                conn.close()
                continue
            try:
                _send(conn, ("welcome", None))
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


class RankGroup:
    """Rank 0's view of the group: its local followers and, in a multi-node group, the other nodes."""

    def __init__(
        self, settings: GroupSettings, factory: WorkerFactory, payload: Any, channel: ControlChannel | None = None
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
        self.replies, self.inboxes, self.followers = _spawn_followers(
            settings, settings.local_ranks[1:], factory, payload
        )
        for node, conn in self.remotes.items():
            threading.Thread(
                target=self._listen, args=(node, conn), name=f"{settings.name}-node{node}", daemon=True
            ).start()
        self.device = join_group(0, settings)
        self.worker = factory(0, self.device, payload)
        self._await_replies(STARTUP_TIMEOUT_S)
        logger.info("%s: group of %d ranks on %d node(s) ready", settings.name, settings.world_size, settings.nnodes)

    def _listen(self, node: int, conn: Connection) -> None:
        """Puts a node's replies with the local ones; records why the node's connection ended."""
        try:
            while True:
                rank, status, detail = _receive(conn)
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
            self._failure = lost or _dead_follower(self.settings.name, self.followers)
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
                _send(conn, None)
                conn.close()
        _stop_followers(self.inboxes, self.followers, wait_s=10)
        if dist.is_initialized():
            dist.destroy_process_group()


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
    _send(conn, ("hello", settings.node_rank, settings.world_size))
    if not conn.poll(timeout):
        raise GroupFailure(f"{where} did not answer this node's hello within {timeout:.0f} s")
    kind, detail = _receive(conn)
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
        self.replies, self.inboxes, self.followers = _spawn_followers(settings, settings.local_ranks, factory, payload)
        threading.Thread(target=self._hand_messages, name=f"{settings.name}-messages", daemon=True).start()
        threading.Thread(target=self._send_replies, name=f"{settings.name}-replies", daemon=True).start()

    def failure(self) -> str | None:
        """Why this node's part of the group cannot go on, or None."""
        return self._stopped_by_node0 or _dead_follower(self.settings.name, self.followers)

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
            while (message := _receive(self.conn)) is not None:
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
                _send(self.conn, reply)
            except OSError as error:
                reason = f"lost the connection to node 0 ({error})"
                break
        if self._closing:
            return
        self.ended = reason
        logger.error("%s node %d: the group ended: %s", self.settings.name, self.settings.node_rank, reason)
        with contextlib.suppress(OSError):
            _send(self.conn, (None, "failed", reason))
        self.on_end(reason)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self.conn.close()
        # Once the group has ended, ranks wait in collectives that will never complete: do not wait for them.
        _stop_followers(self.inboxes, self.followers, wait_s=5 if self.ended is None else 0)


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
) -> None:
    """Runs node r > 0 until SIGTERM, or until its group ends (then raises SystemExit, non-zero, to be restarted).

    It does not serve the stage's API (node 0 does), only grpc.health.v1 on `port`:
    NOT_SERVING until its ranks are ready, SERVING while they are, NOT_SERVING as it
    drains, so Kubernetes' gRPC probes work on every node. With `credentials` (the
    stage's --tls-cert) it answers over TLS, as node 0 does, so one probe fits every node.
    """
    name = f"{settings.name} node {settings.node_rank}"
    nodes: list[FollowerNode] = []

    def stop_serving(reason: str) -> None:
        # The group cannot come back without node 0: drain and exit, as SIGTERM would have us do.
        os.kill(os.getpid(), signal.SIGTERM)

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
