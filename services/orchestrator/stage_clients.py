"""Channels to the stages, each a pool of interchangeable replicas, and how failures reach users.

The orchestrator has endpoints for the stage kinds it was given (services/stage_table.py lists every kind);
which of them a request needs is its model's family's chain (services/orchestrator/chain.py), and which
replicas of each serve its model is its route (services/orchestrator/routes.py), learned from the DiT replicas
after every round of probes.

Stages are pure functions of their requests, so any replica of a stage that serves
the call's model can take it. A `Stage` picks, for every call, the healthy such replica with the
fewest calls in flight (ties go round robin), and `StagePool` probes every
replica's grpc.health.v1 in the background: a replica whose call fails with
UNAVAILABLE, or whose probe fails, is taken out of rotation at once; it rejoins
once a probe finds it SERVING again and its StageInfo has been fetched anew.

Any failure of a stage call becomes a `StageError` that names the stage and the
replica's endpoint, so an operator who sees UNAVAILABLE knows which process to look at;
tenants other than admins read it without the endpoint (error_redaction.py).

Every channel, health probes included, carries the cluster secret when there is
one, and runs over TLS when given channel credentials (`--stage-tls-ca`): the
secret then never crosses the network in clear.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import cluster_secret_interceptors
from services.metrics import OrchestratorMetrics
from services.orchestrator.demand import StageDemand
from services.orchestrator.discovery import Lookup, StageSources, system_lookup
from services.orchestrator.routes import Accepts, ModelRoute, ModelRoutes, accept_any
from services.server import GRPC_OPTIONS
from services.stage_table import STAGES
from services.tracing import client_interceptors as tracing_client_interceptors
from stagediff.v1 import stages_pb2, stages_pb2_grpc

logger = logging.getLogger(__name__)

# Every stage kind, in the order a chain runs them.
STAGE_ORDER = tuple(STAGES)
SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
UNKNOWN = "UNKNOWN"
HEALTH_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 1.0
REPLICA_WAIT_S = 5.0
# A killed replica that comes back should be reachable within about a probe
# interval, not after grpc's default reconnect backoff (which grows to minutes).
STAGE_CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class StageError(Exception):
    """A stage call failed; `code` is the status the job ends with."""

    def __init__(self, stage: str, endpoint: str, code: grpc.StatusCode, detail: str) -> None:
        self.stage = stage
        self.endpoint = endpoint
        self.code = code
        self.detail = detail
        if code == grpc.StatusCode.UNAVAILABLE:
            message = f"stage '{stage}' at {endpoint} is unavailable: {detail}"
        else:
            message = f"stage '{stage}' at {endpoint} failed with {code.name}: {detail}"
        super().__init__(message)


@dataclass(eq=False)  # replicas compare by identity: each has its own channel
class StageClient:
    """One replica of a stage: its channel and stubs, and what the orchestrator knows of it."""

    name: str
    endpoint: str
    info: stages_pb2.StageInfo | None = None
    health: str = UNKNOWN
    detail: str = "not checked yet"
    in_flight: int = 0
    calls: int = 0  # stage calls started on this replica since the orchestrator started
    # Bumped whenever the replica is taken out of rotation, so that a probe answered
    # before a call failed cannot put a replica that just died back into rotation.
    epoch: int = 0
    # The cluster's shared secret, sent with every call (stages refuse calls without it when they have one).
    secret: str | None = field(default=None, repr=False)
    # TLS for the channel (trusted CA, and a client certificate for mutual TLS); None: plaintext.
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    # The name the replica's certificate is checked against when it is not the endpoint's host (an address
    # found by looking a name up: discovery.py).
    server_name: str | None = None
    channel: grpc.aio.Channel = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The trace context of the job's span goes with every call, so one trace spans every stage.
        interceptors = tracing_client_interceptors()
        if self.secret:
            interceptors = [*cluster_secret_interceptors(self.secret), *interceptors]
        if self.credentials is not None:
            named = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
            self.channel = grpc.aio.secure_channel(
                self.endpoint, self.credentials, options=[*STAGE_CHANNEL_OPTIONS, *named], interceptors=interceptors
            )
        else:
            self.channel = grpc.aio.insecure_channel(
                self.endpoint, options=STAGE_CHANNEL_OPTIONS, interceptors=interceptors
            )
        self.control = stages_pb2_grpc.StageControlStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.text_encoder = stages_pb2_grpc.TextEncoderStub(self.channel)
        self.denoiser = stages_pb2_grpc.DenoiserStub(self.channel)
        self.vae = stages_pb2_grpc.VaeDecoderStub(self.channel)
        self.interpolator = stages_pb2_grpc.InterpolatorStub(self.channel)

    @property
    def serving(self) -> bool:
        return self.health == SERVING

    def error(self, rpc_error: grpc.aio.AioRpcError) -> StageError:
        return StageError(self.name, self.endpoint, rpc_error.code(), rpc_error.details() or "")

    async def check_health(self, timeout: float = HEALTH_TIMEOUT_S) -> tuple[str, str]:
        """Returns (health, detail): SERVING, NOT_SERVING or UNKNOWN, and why when not serving."""
        try:
            response = await self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            return NOT_SERVING, f"unreachable: {error.code().name}: {error.details()}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        if status == SERVING:
            return status, ""
        if status == NOT_SERVING:
            return status, "loading or draining"
        return UNKNOWN, status

    async def close(self) -> None:
        await self.channel.close(None)  # no grace: grpc-stubs lack the default


class Stage:
    """The replicas of one stage, and the choice of which one takes the next call."""

    def __init__(
        self,
        name: str,
        endpoints: Sequence[str],
        replica_wait_s: float = REPLICA_WAIT_S,
        secret: str | None = None,
        metrics: OrchestratorMetrics | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        looked_up: str = "",
        cold_start_s: float = 0.0,
    ) -> None:
        """`looked_up`: the stage's flag when it names sources looked up later (discovery.py), whose endpoints
        join through `reconcile`; the stage may then start with none. `cold_start_s`: how long a call waits
        where no replica serves its model (--cold-start-timeout; 0: `replica_wait_s`)."""
        if not endpoints and not looked_up:
            raise ValueError(f"no endpoint for stage {name}")
        duplicates = sorted({endpoint for endpoint in endpoints if endpoints.count(endpoint) > 1})
        if duplicates:
            raise ValueError(f"stage {name} lists {', '.join(duplicates)} more than once")
        self.name = name
        self.looked_up = looked_up
        self.secret, self.credentials = secret, credentials
        self.replica_wait_s = replica_wait_s
        self.cold_start_s = cold_start_s
        self.demand = StageDemand()  # its calls per model, for the autoscaling metrics (demand.py)
        self.metrics = metrics
        self.replicas: list[StageClient] = []
        self.retiring: list[StageClient] = []  # no longer listed, closed once their calls in flight end
        self._next = 0  # round-robin cursor among equally loaded replicas
        self._changed = asyncio.Condition()
        self.reconcile(endpoints)

    @property
    def endpoint(self) -> str:
        """Every replica's endpoint, comma-separated (the form the orchestrator's flags take), or the flag
        whose lookups found none yet."""
        return ",".join(replica.endpoint for replica in self.replicas) or self.looked_up

    def reconcile(self, endpoints: Sequence[str], server_names: Mapping[str, str | None] | None = None) -> None:
        """Makes the replicas those of `endpoints`, in that order: a new one joins out of rotation until a probe
        finds it SERVING; one no longer listed takes no new call and is closed once its calls have ended.
        `server_names`: the name a looked-up endpoint's certificate is checked against."""
        current = {replica.endpoint: replica for replica in self.replicas}
        wanted = list(dict.fromkeys(endpoints))
        for replica in self.replicas:
            if replica.endpoint not in wanted:
                logger.info(
                    "stage %s replica %s is no longer listed: it takes no new call", self.name, replica.endpoint
                )
                self.retiring.append(replica)
        replicas = []
        for endpoint in wanted:
            known = current.get(endpoint)
            if known is None:
                server_name = (server_names or {}).get(endpoint)
                known = StageClient(
                    self.name, endpoint, secret=self.secret, credentials=self.credentials, server_name=server_name
                )
                if self.metrics is not None:
                    self.metrics.set_stage_health(self.name, endpoint, False)
            replicas.append(known)
        self.replicas = replicas
        self._next = self._next % len(replicas) if replicas else 0

    async def close_retired(self) -> None:
        """Closes the replicas no longer listed whose calls have all ended, and forgets their metrics."""
        done = [replica for replica in self.retiring if replica.in_flight == 0]
        self.retiring = [replica for replica in self.retiring if replica.in_flight > 0]
        for replica in done:
            await replica.close()
            if self.metrics is not None:
                self.metrics.forget_stage_replica(self.name, replica.endpoint)

    @property
    def info(self) -> stages_pb2.StageInfo | None:
        """The StageInfo of a serving replica, else the last one fetched from any."""
        return self.info_for(accept_any)

    def info_for(self, accepts: Accepts) -> stages_pb2.StageInfo | None:
        """The StageInfo of a serving replica that `accepts` takes, else the last one fetched from any it takes."""
        known = [replica for replica in self.replicas if replica.info is not None and accepts(replica.info)]
        serving = [replica for replica in known if replica.serving]
        return (serving or known)[0].info if known else None

    def serving(self, accepts: Accepts = accept_any) -> list[StageClient]:
        """The serving replicas (of those `accepts` takes)."""
        return [
            replica
            for replica in self.replicas
            if replica.serving and replica.info is not None and accepts(replica.info)
        ]

    @property
    def health(self) -> str:
        """SERVING while any replica serves; else NOT_SERVING, or UNKNOWN when no replica has answered."""
        if self.serving():
            return SERVING
        return UNKNOWN if all(replica.health == UNKNOWN for replica in self.replicas) else NOT_SERVING

    @property
    def detail(self) -> str:
        """Why the stage is not serving: each replica's reason (just the reason when there is one replica)."""
        if self.serving():
            return ""
        if not self.replicas:
            return f"no replica{self._scaled_to_zero()}"
        if len(self.replicas) == 1:
            return self.replicas[0].detail
        return "; ".join(f"{replica.endpoint}: {replica.detail}" for replica in self.replicas)

    def pick(self, accepts: Accepts = accept_any) -> StageClient | None:
        """The serving replica (of those `accepts` takes) with the fewest calls in flight; ties go round robin."""
        count = len(self.replicas)
        in_turn = (self.replicas[(self._next + offset) % count] for offset in range(count))
        candidates = [
            replica for replica in in_turn if replica.serving and replica.info is not None and accepts(replica.info)
        ]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda replica: replica.in_flight)  # min keeps the first of equals
        self._next = (self.replicas.index(chosen) + 1) % count
        return chosen

    @contextlib.asynccontextmanager
    async def acquire(
        self, accepts: Accepts = accept_any, model: str = "", replica: StageClient | None = None
    ) -> AsyncIterator[StageClient]:
        """A replica for one call (one that `accepts` takes: one serving `model`; `replica` where it still serves,
        the DiT gate's choice), counted in flight until the block ends. When no such replica is serving, waits up to
        `replica_wait_s` for one to come back (the job's own deadline still applies), then raises UNAVAILABLE."""
        if replica is None or not replica.serving:
            replica = self.pick(accepts) or await self._wait_for_replica(accepts, model)
        replica.in_flight += 1
        replica.calls += 1
        try:
            with self.demand.calling(model):
                yield replica
        finally:
            replica.in_flight -= 1

    @contextlib.asynccontextmanager
    async def call(
        self, accepts: Accepts = accept_any, model: str = "", replica: StageClient | None = None
    ) -> AsyncIterator[StageClient]:
        """`acquire`, and a failed call in the block raised as the StageError that `failed` makes of it."""
        async with self.acquire(accepts, model, replica) as chosen:
            timed = (
                self.metrics.time_stage_call(self.name, chosen.endpoint, model)
                if self.metrics is not None
                else contextlib.nullcontext()
            )
            with timed:
                try:
                    yield chosen
                except grpc.aio.AioRpcError as error:
                    raise self.failed(chosen, error) from None

    def _scaled_to_zero(self) -> str:
        if not self.cold_start_s:
            return ""
        return f": scaled to zero, a call waits up to {self.cold_start_s:g} s for one to start (--cold-start-timeout)"

    async def _wait_for_replica(self, accepts: Accepts, model: str) -> StageClient:
        """A replica that `accepts` takes, once one serves: waits up to `cold_start_s` (a pool at zero starting
        on demand), else `replica_wait_s`, in the order the calls came (the Condition wakes them in turn)."""
        loop = asyncio.get_running_loop()
        wait_s = self.cold_start_s or self.replica_wait_s
        give_up_at = loop.time() + wait_s
        if self.cold_start_s:
            logger.info("stage %s: no replica serves model '%s'; a call waits for one to start", self.name, model)
        with self.demand.waiting_for_replica(model):
            async with self._changed:
                while (replica := self.pick(accepts)) is None:
                    remaining = give_up_at - loop.time()
                    if remaining <= 0:
                        if self.serving() and model:
                            why = f"no replica serving model '{model}' came within {wait_s:g} s"
                        else:
                            why = f"no replica came within {wait_s:g} s ({self.detail})"
                        raise StageError(self.name, self.endpoint, grpc.StatusCode.UNAVAILABLE, why)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=remaining)
        return replica

    async def wait_serving(self) -> None:
        """Returns once some replica serves."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self.serving()))

    def mark_down(self, replica: StageClient, health: str, detail: str) -> None:
        """Takes a replica out of rotation; calls already running on it are left to finish or fail."""
        if replica.serving:
            logger.warning("stage %s replica %s is out of rotation: %s", self.name, replica.endpoint, detail)
        replica.epoch += 1
        replica.health = health
        replica.detail = detail
        if self.metrics is not None:
            self.metrics.set_stage_health(self.name, replica.endpoint, False)

    async def _mark_serving(self, replica: StageClient) -> None:
        if not replica.serving:
            logger.info("stage %s replica %s is serving", self.name, replica.endpoint)
        replica.health, replica.detail = SERVING, ""
        if self.metrics is not None:
            self.metrics.set_stage_health(self.name, replica.endpoint, True)
        async with self._changed:
            self._changed.notify_all()

    def failed(self, replica: StageClient, rpc_error: grpc.aio.AioRpcError) -> StageError:
        """The StageError for a failed call; UNAVAILABLE also takes the replica out of rotation."""
        if rpc_error.code() == grpc.StatusCode.UNAVAILABLE:
            self.mark_down(replica, NOT_SERVING, f"a call failed: UNAVAILABLE: {rpc_error.details()}")
        return replica.error(rpc_error)

    async def probe(self, replica: StageClient) -> None:
        """One health check of a replica: down at once on failure; back in rotation once SERVING and its
        StageInfo is fetched again (it may have restarted with other settings)."""
        epoch = replica.epoch
        health, detail = await replica.check_health()
        if health != SERVING:
            self.mark_down(replica, health, detail)
            return
        if replica.serving:
            return
        try:
            info = await replica.control.GetStageInfo(stages_pb2.GetStageInfoRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            self.mark_down(replica, NOT_SERVING, f"info unavailable: {error.code().name}: {error.details()}")
            return
        if replica.epoch != epoch:  # a call failed meanwhile: wait for the next probe
            return
        replica.info = info
        await self._mark_serving(replica)

    async def close(self) -> None:
        for replica in [*self.replicas, *self.retiring]:
            await replica.close()


class StagePool:
    """The stages this orchestrator has endpoints for, each a pool of replicas, with a background task that
    probes every replica. A stage kind without endpoints is left out: `stages` holds only those given."""

    def __init__(
        self,
        endpoints: Mapping[str, str | Sequence[str]],
        probe_interval_s: float = PROBE_INTERVAL_S,
        replica_wait_s: float = REPLICA_WAIT_S,
        secret: str | None = None,
        metrics: OrchestratorMetrics | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        lookup: Lookup = system_lookup,
        cold_start_s: float = 0.0,
    ) -> None:
        """`endpoints`: each stage's sources (discovery.py: HOST:PORT and dns:NAME:PORT, comma-separated or a
        list); `lookup` resolves the names, every probe interval. `cold_start_s` > 0: stages may be at zero
        (--cold-start-timeout): calls wait that long for a replica, and the pool is ready without any."""
        unknown = sorted(set(endpoints) - set(STAGE_ORDER))
        if unknown:
            raise ValueError(f"no stage kind named {', '.join(unknown)}; the kinds are {', '.join(STAGE_ORDER)}")
        self.sources = {
            name: StageSources.parse(name, value) for name in STAGE_ORDER if (value := endpoints.get(name) or [])
        }
        self.sources = {name: sources for name, sources in self.sources.items() if sources.flag}
        self.stages = {
            name: Stage(
                name,
                list(sources.endpoints),
                replica_wait_s,
                secret,
                metrics,
                credentials,
                looked_up=sources.flag if sources.names else "",
                cold_start_s=cold_start_s,
            )
            for name, sources in self.sources.items()
        }
        self.lookup = lookup
        self.probe_interval_s = probe_interval_s
        self.cold_start_s = cold_start_s
        # Called with the routes the DiT replicas reported in each round of probes (model_catalog.py keeps them).
        self.on_models: Callable[[list[ModelRoute]], None] | None = None
        self._prober: asyncio.Task | None = None
        # Every model a DiT replica has reported, kept when its replicas go (routes.py): its jobs wait for one.
        self.routes = ModelRoutes()

    def __getitem__(self, name: str) -> Stage:
        return self.stages[name]

    def replicas(self) -> list[tuple[Stage, StageClient]]:
        return [(stage, replica) for stage in self.stages.values() for replica in stage.replicas]

    async def discover(self) -> None:
        """Looks the stages' names up again and reconciles each stage with what they say (a failed lookup
        leaves its stage as it was), then closes the replicas no longer listed whose calls have ended."""
        for name, sources in self.sources.items():
            stage = self.stages[name]
            if sources.names:
                try:
                    found = await sources.resolve(self.lookup)
                    stage.reconcile(list(found), found)
                except OSError as error:
                    logger.warning("stage %s: looking up %s failed: %s; its replicas stay as they were", name,
                                   sources.flag, error)  # fmt: skip
            await stage.close_retired()

    async def probe_all(self) -> None:
        """Checks every replica now (the background task does this every `probe_interval_s`), and learns the
        models the DiT replicas serve."""
        await asyncio.gather(*(stage.probe(replica) for stage, replica in self.replicas()))
        if "dit" in self.stages:
            reported = self.routes.learn(self.stages["dit"].replicas)
            if self.on_models is not None:
                self.on_models(reported)

    def start_probing(self) -> None:
        if self._prober is None:
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever(), name="stage-probes")

    async def _probe_forever(self) -> None:
        while True:
            try:
                await self.discover()
                await self.probe_all()
            except Exception:  # a probe must never stop the probing
                logger.exception("probing the stage replicas failed")
            await asyncio.sleep(self.probe_interval_s)

    async def wait_until_serving(self) -> None:
        """Starts the probes and waits until every stage has a serving replica (the others join when ready); with
        `cold_start_s`, only for the first round of lookups and probes (a stage may be at zero)."""
        if self.cold_start_s:
            await self.discover()
            await self.probe_all()
            self.start_probing()
            return
        self.start_probing()
        for stage in self.stages.values():
            await stage.wait_serving()
            logger.info("stage %s is serving at %s", stage.name, ",".join(r.endpoint for r in stage.serving()))

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None
        for stage in self.stages.values():
            await stage.close()
