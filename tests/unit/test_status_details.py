"""RESOURCE_EXHAUSTED with google.rpc.RetryInfo, from an aio servicer to aio and sync clients."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from services.orchestrator.tenants import RateLimited, TenantRegistry, hash_api_key
from stagediff.status_details import DETAILS_METADATA_KEY, abort_with_retry, retry_after, retry_status, rich_status

SERVICE = "test.Limited"


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _handlers(registry: TenantRegistry) -> dict[str, grpc.RpcMethodHandler]:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort_with_retry(context, "slow down", 2.5)

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        await abort_with_retry(context, "queue full", 0.25)

    async def plain(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no advice")

    async def other_code(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort_with_retry(context, "draining", 1.5, code=grpc.StatusCode.UNAVAILABLE)

    async def mismatched(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # Details that describe some other status must not be taken for this call's.
        stale = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="old")
        stale.details.add().Pack(error_details_pb2.RetryInfo())
        await context.abort(grpc.StatusCode.INTERNAL, "boom", ((DETAILS_METADATA_KEY, stale.SerializeToString()),))

    async def rate_limited(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        tenant = registry.tenants["acme"]
        try:
            registry.check_rate(tenant)
        except RateLimited as error:
            await abort_with_retry(context, error.message, error.retry_after)
        return b"ok"

    return {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Plain": grpc.unary_unary_rpc_method_handler(plain),
        "OtherCode": grpc.unary_unary_rpc_method_handler(other_code),
        "Mismatched": grpc.unary_unary_rpc_method_handler(mismatched),
        "RateLimited": grpc.unary_unary_rpc_method_handler(rate_limited),
    }


def _run(scenario, registry: TenantRegistry | None = None):
    """Starts a real aio server on a free port and runs `scenario(target)` against it."""
    registry = registry or TenantRegistry.open()

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _handlers(registry)),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await scenario(f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    return asyncio.run(main())


async def _aio_error(target: str, method: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/{method}")(b"", timeout=10)
    return caught.value


def test_aio_client_reads_the_retry_delay() -> None:
    error = _run(lambda target: _aio_error(target, "Unary"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "slow down"  # clients unaware of the details still read a message
    assert retry_after(error) == pytest.approx(2.5)
    status = rich_status(error)
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and status.message == "slow down"


def test_sync_client_reads_the_retry_delay() -> None:
    def call(target: str) -> grpc.RpcError:
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(f"/{SERVICE}/Unary")(b"", timeout=10)
        return caught.value

    async def scenario(target: str) -> grpc.RpcError:
        return await asyncio.to_thread(call, target)  # a blocking client must not stall the server's loop

    error = _run(scenario)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after(error) == pytest.approx(2.5)


def test_a_stream_that_ends_with_retry_info_after_a_message() -> None:
    async def scenario(target: str):
        received = []
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for message in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10):
                    received.append(message)
        return received, caught.value

    received, error = _run(scenario)
    assert received == [b"first"]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after(error) == pytest.approx(0.25)


def test_no_retry_info_reads_as_none() -> None:
    error = _run(lambda target: _aio_error(target, "Plain"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rich_status(error) is None and retry_after(error) is None


def test_other_codes_can_carry_retry_info() -> None:
    error = _run(lambda target: _aio_error(target, "OtherCode"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and retry_after(error) == pytest.approx(1.5)


def test_details_that_disagree_with_the_call_status_are_ignored() -> None:
    error = _run(lambda target: _aio_error(target, "Mismatched"))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert rich_status(error) is None and retry_after(error) is None


def test_a_tenant_over_its_rate_is_told_when_to_come_back() -> None:
    clock = FakeClock()
    registry = TenantRegistry.from_dict(
        {
            "tenants": [
                {
                    "name": "acme",
                    "api_keys": [hash_api_key("sd_key")],
                    "quotas": {"requests_per_minute": 6, "burst": 1},
                }
            ]
        },
        clock=clock,
    )

    async def scenario(target: str):
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(f"/{SERVICE}/RateLimited")
            first = await call(b"", timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"", timeout=10)
            clock.now += 10.0
            again = await call(b"", timeout=10)
        return first, caught.value, again

    first, error, again = _run(scenario, registry)
    assert first == b"ok" and again == b"ok"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'acme'" in error.details() and "6 requests per minute" in error.details()
    assert retry_after(error) == pytest.approx(10.0)


@pytest.mark.parametrize("delay", [-1.0, math.nan, math.inf])
def test_retry_status_refuses_a_delay_that_is_not_one(delay: float) -> None:
    with pytest.raises(ValueError, match="retry_after_s"):
        retry_status("x", delay)


def test_retry_status_refuses_ok() -> None:
    with pytest.raises(ValueError, match="OK"):
        retry_status("x", 1.0, code=grpc.StatusCode.OK)


def test_retry_status_encodes_the_delay_exactly() -> None:
    status = retry_status("wait", 12.5)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED and status.details == "wait"
    ((key, value),) = status.trailing_metadata
    assert key == DETAILS_METADATA_KEY
    info = error_details_pb2.RetryInfo()
    status_pb2.Status.FromString(value).details[0].Unpack(info)
    assert info.retry_delay.seconds == 12 and info.retry_delay.nanos == 500_000_000
