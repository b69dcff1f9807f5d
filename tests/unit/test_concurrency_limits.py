"""Bounded concurrency: calls per server, health Watch streams, and the log lines refused callers cause."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import ClusterSecretInterceptor, RateLimitedLog
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenants import TenantRegistry, hash_api_key
from services.server import serve
from services.server_config import ServerConfig
from services.stage_table import SERVE_TARGETS
from stagediff.status_details import retry_after
from tests.helpers.grpc_channels import assert_status
from tests.helpers.secure_defaults import serve_defaults

SERVICE = "test.Limits"
SECRET = "cluster-secret-0123456789abcdefghijklmnop"
KEY = "sd_acme-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------ rate-limited log --


def test_a_rate_limited_log_writes_one_line_per_interval_and_counts_the_rest(caplog) -> None:
    clock = FakeClock()
    log = RateLimitedLog(logging.getLogger("test.refusals"), logging.WARNING, interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        written = [log.log("secret", "refused %s", f"call {index}") for index in range(50)]
        assert written == [True] + [False] * 49
        assert log.log("key", "refused %s", "another kind") is True, "each kind has its own budget"
        clock.now += 0.999
        assert log.log("secret", "refused %s", "still within the second") is False
        clock.now += 0.001
        assert log.log("secret", "refused %s", "next second") is True
        clock.now += 5
        assert log.log("secret", "refused %s", "quiet since") is True
    assert [record.getMessage() for record in caplog.records] == [
        "refused call 0",
        "refused another kind",
        "refused next second (and 50 more since the last such line, not logged one by one)",
        "refused quiet since",
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gate:
    """A service whose Hold streams stay open until released, and a Ping that answers at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def register(self, server: grpc.aio.Server) -> list[str]:
        async def hold(request, context):
            yield b"held"
            await self.release.wait()

        async def ping(request, context):
            return b"pong"

        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Hold": grpc.unary_stream_rpc_method_handler(hold),
                        "Ping": grpc.unary_unary_rpc_method_handler(ping),
                    },
                ),
            )
        )
        return [SERVICE]


@contextlib.asynccontextmanager
async def _serving(gate: Gate, **options) -> AsyncIterator[grpc.aio.Channel]:
    """services.server.serve on a free port (stopped by SIGTERM, as in production), and a channel to it."""
    port = _free_port()
    serving = asyncio.create_task(
        serve(name="limits-test", host="127.0.0.1", port=port, register=gate.register, grace=1.0, **options)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            while (await health.Check(request, wait_for_ready=True, timeout=30)).status != (
                health_pb2.HealthCheckResponse.SERVING
            ):
                await asyncio.sleep(0.05)
            yield channel
    finally:
        gate.release.set()
        if not serving.done():
            os.kill(os.getpid(), signal.SIGTERM)  # serve() turns SIGTERM into a graceful stop
        await asyncio.wait_for(serving, timeout=30)


async def _open_hold(channel: grpc.aio.Channel):
    """A Hold stream, once the server runs it (its first message arrived)."""
    call = channel.unary_stream(f"/{SERVICE}/Hold")(b"", timeout=30)
    assert await call.read() == b"held"
    return call


async def _open_watch(channel: grpc.aio.Channel):
    """A health Watch stream, once the server runs it (the first status arrived)."""
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    first = await call.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    return call


# ------------------------------------------------------- concurrent rpcs --


def test_calls_beyond_max_concurrent_rpcs_are_resource_exhausted() -> None:
    async def scenario():
        gate = Gate()
        async with _serving(gate, max_concurrent_rpcs=2) as channel:
            holds = [await _open_hold(channel) for _ in range(2)]
            ping = channel.unary_unary(f"/{SERVICE}/Ping")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await ping(b"", timeout=10)
            gate.release.set()
            for hold in holds:
                assert await hold.read() == grpc.aio.EOF
            return caught.value, await ping(b"", timeout=10)

    refused, answered = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert answered == b"pong", "once the calls in flight end, calls are served again"


# ------------------------------------------------------ health watchers --


def test_health_watch_streams_are_capped_and_leave_room_for_calls() -> None:
    async def scenario():
        gate = Gate()
        async with _serving(gate, max_concurrent_rpcs=8, max_health_watchers=2) as channel:
            watchers = [await _open_watch(channel) for _ in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _open_watch(channel)
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            pong = await channel.unary_unary(f"/{SERVICE}/Ping")(b"", timeout=10)
            watchers[0].cancel()
            # The freed slot is usable again once the server has seen the cancellation.
            reopened = None
            for _ in range(200):
                try:
                    reopened = await _open_watch(channel)
                    break
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            for watcher in (watchers[1], reopened):
                if watcher is not None:
                    watcher.cancel()
            return caught.value, check, pong, reopened

    refused, check, pong, reopened = asyncio.run(scenario())
    assert_status(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, "Watch", "--max-health-watchers 2", "Check")
    assert retry_after(refused) is not None
    assert check.status == health_pb2.HealthCheckResponse.SERVING, "Check is not a watcher"
    assert pong == b"pong"
    assert reopened is not None, "a closed Watch gives its slot back"


# --------------------------------------------------------------- flags --


@pytest.mark.parametrize("target", [target for target in SERVE_TARGETS if target != "http"])
def test_every_server_has_generous_limits_by_default(target: str) -> None:
    args = serve_defaults(target)
    assert args.max_concurrent_rpcs == (1024 if target == "orchestrator" else 256)
    assert args.max_health_watchers == 32
    ServerConfig.from_options(args)


def test_the_http_gateway_limits_its_requests_and_bodies_by_default() -> None:
    """The gateway speaks HTTP: uvicorn answers 503 beyond --max-concurrent-requests, bodies are bounded (one
    16 MiB image as base64, with 1 MiB for the other fields), and so are the times to send a request."""
    args = serve_defaults("http")
    assert (args.max_concurrent_requests, args.max_body_bytes) == (1024, 4 * -(-(16 << 20) // 3) + (1 << 20))
    assert (args.header_timeout, args.body_timeout, args.max_downloads_per_key, args.openapi) == (10, 120, 4, False)


@pytest.mark.parametrize(
    ("rpcs", "watchers", "words"),
    [
        (0, 0, ["--max-concurrent-rpcs 0: use 1 or more"]),
        (8, 8, ["--max-health-watchers 8", "less than --max-concurrent-rpcs (8)"]),
        (8, -1, ["--max-health-watchers -1"]),
    ],
)
def test_limits_that_leave_no_room_for_calls_are_refused(rpcs: int, watchers: int, words: list[str]) -> None:
    defaults = ServerConfig.from_options(serve_defaults("vae"))
    with pytest.raises(ValueError) as refused:
        dataclasses.replace(defaults, max_concurrent_rpcs=rpcs, max_health_watchers=watchers)
    for word in words:
        assert word in str(refused.value)


# ------------------------------------------------------ refusal logging --


def _refused_calls(interceptor: grpc.aio.ServerInterceptor, calls: int, metadata=()) -> list[grpc.StatusCode]:
    """`calls` unary calls to a server behind `interceptor` that refuses them; their status codes."""

    async def scenario():
        server = grpc.aio.server(interceptors=[interceptor])
        Gate().register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                ping = channel.unary_unary(f"/{SERVICE}/Ping")
                for _ in range(calls):
                    try:
                        await ping(b"", metadata=metadata, timeout=10)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as error:
                        codes.append(error.code())
        finally:
            await server.stop(None)
        return codes

    return asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["cluster secret", "api key"])
def test_refused_callers_are_logged_at_a_bounded_rate(kind: str, caplog) -> None:
    if kind == "cluster secret":
        interceptor = ClusterSecretInterceptor(SECRET)
        metadata = (("x-stagediff-cluster-secret", "not-the-secret"),)
    else:
        interceptor = TenantAuthInterceptor(
            TenantRegistry.from_dict({"tenants": [{"name": "acme", "api_keys": [hash_api_key(KEY)]}]})
        )
        metadata = (("authorization", "Bearer sd_wrong-0123456789abcdefghijklmnopqrstuvwxyzABCD"),)
    clock = FakeClock()
    interceptor.refusals.clock = clock  # every refusal below falls within one second, then one more after it
    with caplog.at_level(logging.INFO, logger="services"):
        codes = _refused_calls(interceptor, 40, metadata)
        clock.now += 1.0
        codes += _refused_calls(interceptor, 1, metadata)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 41
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("refused")]
    assert len(lines) == 2, lines
    assert lines[1].endswith("(and 39 more since the last such line, not logged one by one)")
