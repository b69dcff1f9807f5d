"""A stage's compute thread serves higher-priority calls first: the executor's order, the places calls get from
their metadata, and the orchestrator sending each job's class to every stage it calls."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import CancelledError, Future
from pathlib import Path

import grpc
import pytest

from services.orchestrator.tenants import TenantRegistry, hash_api_key
from services.stage_priority import (
    PRIORITY_METADATA,
    CallPriorityInterceptor,
    PriorityExecutor,
    call_metadata,
    class_rank,
    current_place,
    running_as,
)
from tests.helpers.fake_stages import ChainOrchestrator, FakeStages, generate, generate_request


def _submit_as(executor: PriorityExecutor, place: tuple[int, int], fn, *args) -> Future:
    """Submits `fn` from a context whose call has `place`, as a call's handler does."""

    def submit() -> Future:
        running_as(place)
        return executor.submit(fn, *args)

    return contextvars.Context().run(submit)


def _blocked(executor: PriorityExecutor) -> threading.Event:
    """Occupies the worker until the returned event is set, so that what is submitted next queues."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    executor.submit(hold)
    assert started.wait(10)
    return release


def test_queued_work_runs_by_class_then_call_arrival_then_submission() -> None:
    executor = PriorityExecutor(thread_name_prefix="test-compute")
    ran: list[str] = []
    release = _blocked(executor)
    futures = [
        _submit_as(executor, (class_rank("low"), 1), ran.append, "low call 1, first piece"),
        _submit_as(executor, (class_rank("normal"), 2), ran.append, "normal call 2"),
        _submit_as(executor, (class_rank("low"), 1), ran.append, "low call 1, second piece"),
        _submit_as(executor, (class_rank("high"), 4), ran.append, "high call 4"),
        _submit_as(executor, (class_rank("high"), 3), ran.append, "high call 3"),
        _submit_as(executor, (class_rank("low"), 0), ran.append, "low call 0"),
    ]
    release.set()
    for future in futures:
        future.result(10)
    assert ran == [
        "high call 3",
        "high call 4",
        "normal call 2",
        "low call 0",
        "low call 1, first piece",
        "low call 1, second piece",
    ]
    executor.shutdown()


def test_results_errors_and_cancels_reach_the_submitter() -> None:
    executor = PriorityExecutor(thread_name_prefix="test-compute")
    assert executor.submit(sum, [1, 2, 3]).result(10) == 6
    with pytest.raises(ZeroDivisionError):
        executor.submit(lambda: 1 / 0).result(10)
    ran: list[int] = []
    release = _blocked(executor)
    cancelled, kept = executor.submit(ran.append, 1), executor.submit(ran.append, 2)
    assert cancelled.cancel()
    release.set()
    kept.result(10)
    assert ran == [2]
    # Shutting down with cancel_futures cancels what is still queued; nothing is submitted afterwards.
    release = _blocked(executor)
    queued = executor.submit(ran.append, 3)
    executor.shutdown(wait=False, cancel_futures=True)
    release.set()
    with pytest.raises(CancelledError):
        queued.result(10)
    with pytest.raises(RuntimeError):
        executor.submit(ran.append, 4)
    assert ran == [2]


def test_a_call_gets_its_place_from_its_metadata_and_its_arrival() -> None:
    async def run() -> list[tuple[int, int]]:
        async def place(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return repr(current_place()).encode()

        handler = grpc.method_handlers_generic_handler(
            "test.Place", {"Get": grpc.unary_unary_rpc_method_handler(place)}
        )
        server = grpc.aio.server(interceptors=[CallPriorityInterceptor()])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                get = channel.unary_unary("/test.Place/Get")
                places = []
                for metadata in (call_metadata("high"), (), ((PRIORITY_METADATA, "urgent"),), call_metadata("low")):
                    places.append(eval(await get(b"", metadata=metadata, timeout=10)))  # noqa: S307 - a repr of ints
                return places
        finally:
            await server.stop(None)

    places = asyncio.run(run())
    # high, then no metadata and an unknown value (both normal), then low; arrivals count up.
    assert [rank for rank, _ in places] == [0, 1, 1, 2]
    assert [arrival for _, arrival in places] == sorted({arrival for _, arrival in places})
    # Outside any call, work runs as normal.
    assert current_place()[0] == class_rank("normal") == class_rank(None) == class_rank("bogus")
    assert call_metadata("bogus") == ((PRIORITY_METADATA, "normal"),)


def test_the_orchestrator_sends_each_job_s_class_to_every_stage(tmp_path: Path) -> None:
    keys = {"vip": "vip-key", "bulk": "bulk-key", "plain": "plain-key"}
    tenants = TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "vip", "api_keys": [hash_api_key(keys["vip"])], "priority": "high"},
                {"name": "bulk", "api_keys": [hash_api_key(keys["bulk"])], "priority": "low"},
                {"name": "plain", "api_keys": [hash_api_key(keys["plain"])]},
            ]
        }
    )

    async def run() -> FakeStages:
        stages = await FakeStages().start()
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state", tenants=tenants)
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            for name in ("vip", "bulk", "plain"):
                events = await generate(
                    orchestrator.endpoint, generate_request(), [("authorization", f"Bearer {keys[name]}")]
                )
                assert any(event.HasField("result") for event in events)
        finally:
            await orchestrator.stop()
            await stages.stop()
        return stages

    stages = asyncio.run(run())
    for stage in (stages.text_encoder, stages.denoiser, stages.vae):
        assert stage.priorities == ["high", "low", "normal"]
