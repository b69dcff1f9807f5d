"""Stage pools of several replicas: least-loaded choice, taking replicas out and back, failover.

The pool tests run against small real aio servers that answer grpc.health.v1
and GetStageInfo; the end-to-end test kills and restarts real stage processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from services.orchestrator.job import Job, JobState, ResultPiece
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.result_publisher import ResultPublisher
from services.orchestrator.stage_clients import STAGE_ORDER, Stage, StageError, StagePool
from services.orchestrator.store import JobRecord, JobStore
from stagediff.local import up
from stagediff.local.compose import with_replicas
from stagediff.local.supervisor import LocalCluster
from stagediff.tensor_codec import encode_tensor
from stagediff.up_options import parse_replicas
from stagediff.v1 import generation_pb2, stages_pb2
from tests.helpers.fake_replicas import SETTLE_S, eventually, replicas


async def probe(stage: Stage) -> None:
    await asyncio.gather(*(stage.probe(replica) for replica in stage.replicas))


async def encode(stage: Stage) -> str:
    """One Encode call through the pool; returns the endpoint that took it (it always fails)."""
    async with stage.call() as replica:
        async for _ in replica.text_encoder.Encode(stages_pb2.EncodeRequest(texts=["x"])):
            pass
    raise AssertionError("the fake Encode always fails")


def test_least_in_flight_wins_and_ties_go_round_robin() -> None:
    async def scenario() -> None:
        async with replicas(3) as fakes:
            stage = Stage("dit", [fake.endpoint for fake in fakes])
            await probe(stage)
            a, b, c = stage.replicas
            assert [replica.health for replica in stage.replicas] == ["SERVING"] * 3
            # Idle replicas take turns.
            order = []
            for _ in range(6):
                async with stage.acquire() as replica:
                    order.append(replica)
            assert order == [a, b, c, a, b, c]
            # Busy ones are passed over for the least loaded.
            async with contextlib.AsyncExitStack() as held:
                first = await held.enter_async_context(stage.acquire())
                second = await held.enter_async_context(stage.acquire())
                third = await held.enter_async_context(stage.acquire())
                assert {first, second, third} == {a, b, c}
                assert [replica.in_flight for replica in stage.replicas] == [1, 1, 1]
                b.in_flight += 2  # b is busy with other jobs' calls
                async with stage.acquire() as fourth, stage.acquire() as fifth:
                    assert {fourth, fifth} == {a, c}
                b.in_flight -= 2
            assert [replica.in_flight for replica in stage.replicas] == [0, 0, 0]
            assert [replica.calls for replica in stage.replicas] == [4, 3, 4]
            await stage.close()

    asyncio.run(scenario())


def test_a_call_failing_with_unavailable_takes_its_replica_out_at_once() -> None:
    async def scenario() -> None:
        async with replicas(2) as (dead, alive):
            stage = Stage("text-encoder", [dead.endpoint, alive.endpoint])
            await probe(stage)
            with pytest.raises(StageError) as raised:
                await encode(stage)
            error = raised.value
            assert error.code == grpc.StatusCode.UNAVAILABLE
            assert error.stage == "text-encoder" and error.endpoint == dead.endpoint
            assert "'text-encoder'" in str(error) and dead.endpoint in str(error)
            assert stage.replicas[0].health == "NOT_SERVING" and "UNAVAILABLE" in stage.replicas[0].detail
            assert stage.health == "SERVING", "the other replica still serves the stage"
            for _ in range(3):
                async with stage.acquire() as replica:
                    assert replica.endpoint == alive.endpoint
            # Any other failure is the request's, not the replica's: it stays in rotation.
            alive.encode_code = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(StageError) as raised:
                await encode(stage)
            assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert stage.replicas[1].health == "SERVING"
            await stage.close()

    asyncio.run(scenario())


def test_a_replica_that_fails_its_probe_leaves_and_rejoins_with_fresh_info() -> None:
    async def scenario() -> None:
        async with replicas(5) as fakes:
            flaky, steady, encoder, vae, interp = fakes
            endpoints = {
                "text-encoder": encoder.endpoint,
                "dit": f"{flaky.endpoint},{steady.endpoint}",
                "vae": [vae.endpoint],
                "interp": [interp.endpoint],
            }
            pool = StagePool(endpoints, probe_interval_s=0.05)
            await pool.wait_until_serving()
            dit = pool["dit"]
            first, second = dit.replicas
            await eventually(lambda: first.serving and second.serving, "both replicas serve")
            assert first.info.version == "v1" and flaky.info_calls == 1

            # Draining (NOT_SERVING) takes it out; SERVING brings it back.
            await flaky.set_serving(False)
            await eventually(lambda: not first.serving, "a draining replica leaves the rotation")
            assert first.detail == "loading or draining"
            async with dit.acquire() as replica:
                assert replica is second
            await flaky.set_serving(True)
            await eventually(lambda: first.serving, "the replica rejoins")

            # A replica that goes away leaves; back on its port, with other settings, it rejoins with them.
            await flaky.stop()
            await eventually(lambda: not first.serving, "an unreachable replica leaves the rotation")
            assert "unreachable" in first.detail and dit.health == "SERVING"
            for _ in range(3):
                async with dit.acquire() as replica:
                    assert replica is second
            calls_before = flaky.info_calls
            flaky.version = "v2"
            await flaky.start()
            await eventually(lambda: first.serving, "the restarted replica rejoins")
            assert flaky.info_calls > calls_before and first.info.version == "v2"
            chosen = []
            for _ in range(2):
                async with dit.acquire() as replica:
                    chosen.append(replica)
            assert first in chosen, "the rejoined replica takes calls again"
            await pool.close()

    asyncio.run(scenario())


def test_with_no_serving_replica_a_call_waits_a_bounded_time_then_fails_naming_the_stage() -> None:
    async def scenario() -> None:
        async with replicas(1) as (fake,):
            stage = Stage("vae", [fake.endpoint], replica_wait_s=0.3)
            await fake.set_serving(False)
            await probe(stage)
            with pytest.raises(StageError) as raised:
                async with stage.acquire():
                    pass
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE
            assert "'vae'" in str(raised.value) and fake.endpoint in str(raised.value)
            assert "loading or draining" in str(raised.value)

            # A replica that comes back while a call waits takes that call.
            stage.replica_wait_s = SETTLE_S

            async def take() -> str:
                async with stage.acquire() as replica:
                    return replica.endpoint

            waiting = asyncio.create_task(take())
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await fake.set_serving(True)
            await probe(stage)
            assert await asyncio.wait_for(waiting, SETTLE_S) == fake.endpoint
            assert stage.replicas[0].calls == 1
            await stage.close()

    asyncio.run(scenario())


def test_failing_over_to_another_replica_spends_no_stage_retry() -> None:
    """With --stage-retries 0 a job still moves to a second replica; a lone replica gets no retry."""

    async def scenario() -> None:
        async with replicas(2) as (first, second):
            for dit, succeeds in (([first.endpoint, second.endpoint], True), ([first.endpoint], False)):
                pool = StagePool({**{name: [second.endpoint] for name in STAGE_ORDER}, "dit": dit})
                await pool.probe_all()
                pipeline = Pipeline(pool, stage_retries=0, retry_backoff_s=0.0)
                attempts: list[str] = []

                async def run_once(job: Job, pool: StagePool = pool, attempts: list[str] = attempts) -> None:
                    async with pool["dit"].acquire() as replica:
                        attempts.append(replica.endpoint)
                        if replica.endpoint == first.endpoint:
                            pool["dit"].mark_down(replica, "NOT_SERVING", "killed")
                            raise StageError("dit", replica.endpoint, grpc.StatusCode.UNAVAILABLE, "killed")

                pipeline._run_once = run_once
                job = Job(job_id="j", request=generation_pb2.GenerateRequest())
                if succeeds:
                    await pipeline._run_with_retries(job)
                    assert attempts == [first.endpoint, second.endpoint]
                else:
                    with pytest.raises(StageError):
                        await pipeline._run_with_retries(job)
                    assert attempts == [first.endpoint]
                await pool.close()

    asyncio.run(scenario())


def test_a_retry_rewrites_a_tensor_that_was_cut_half_way_and_publishes_it_once(tmp_path) -> None:
    async def scenario() -> None:
        frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
        chunks = list(encode_tensor("frames", frames, index=0, chunk_bytes=20))
        assert len(chunks) > 3
        with JobStore.open(tmp_path) as store:
            job = Job(job_id="j", request=generation_pb2.GenerateRequest())
            store.insert(JobRecord.new("j", "t", job.request))
            store.update_state("j", JobState.JOB_STATE_RUNNING)
            job.result = store.create_result("j", frames.shape)
            first_attempt = ResultPublisher(job, job.result, fps=16.0)
            for chunk in chunks[:3]:
                await first_attempt.publish(chunk)
            assert job.events == []  # a tensor cut half-way was never announced
            for _ in range(2):  # the retry writes it whole; a later retry skips it
                retry = ResultPublisher(job, job.result, fps=16.0)
                for chunk in chunks:
                    await retry.publish(chunk)
            assert job.events == [ResultPiece(0, 2, 16.0)]
            await job.finish(JobState.JOB_STATE_SUCCEEDED)
            sent = [event.result.tensor async for event in job.follow(chunk_bytes=20)]
            assert sent == chunks
            job.result.discard()

    asyncio.run(scenario())


def test_replicas_flag_and_dash_n_services_become_endpoint_lists(tmp_path) -> None:
    args = up.build_parser().parse_args(["--model", "m", "--replicas", "text-encoder=1,dit=2,vae=2,interp=1"])
    assert args.replicas == {"text-encoder": 1, "dit": 2, "vae": 2, "interp": 1}
    for wrong in ("dit=0", "dit", "dit=two"):
        with pytest.raises(argparse.ArgumentTypeError, match="STAGE=COUNT"):
            parse_replicas(wrong)
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    compose = tmp_path / "compose.yml"
    compose.write_text(
        """
services:
  text-encoder:
    command: ["serve", "text-encoder", "--model", "/m", "--port", "7001"]
  dit:
    command: ["serve", "dit", "--model", "/m", "--port", "7002"]
  dit-2:
    command: ["serve", "dit", "--model", "/m", "--port", "7002", "--device", "cuda:1"]
  vae:
    command: ["serve", "vae", "--model", "/m", "--port", "7003"]
  orchestrator:
    command: ["serve", "orchestrator", "--port", "7000", "--dit", "dit:7002", "--vae=vae:7003"]
    depends_on:
      dit: {condition: service_healthy}
      vae: {condition: service_healthy}
"""
    )
    declared = LocalCluster(tmp_path, compose_file=compose)
    ports = {"text-encoder": 9001, "dit": 9002, "dit-2": 9012, "vae": 9003, "orchestrator": 9000}
    plans = declared.plan(local_ports=ports)
    assert plans["dit-2"].args[-2:] == ["--device", "cuda:1"], "a declared replica keeps its own command"
    orchestrator = plans["orchestrator"].args
    assert orchestrator[orchestrator.index("--dit") + 1] == "127.0.0.1:9002,127.0.0.1:9012"
    assert plans["orchestrator"].waits_for == ["dit", "dit-2", "vae"]

    cloned = LocalCluster(tmp_path, compose_file=compose, replicas={"dit": 1, "vae": 3}, extra_args={"vae": ["-x"]})
    assert list(cloned.compose) == ["text-encoder", "dit", "vae", "vae-2", "vae-3", "orchestrator"]
    ports = {"text-encoder": 9001, "dit": 9002, "vae": 9003, "vae-2": 9013, "vae-3": 9023, "orchestrator": 9000}
    plans = cloned.plan(local_ports=ports)
    assert plans["vae-3"].args == ["serve", "vae", "--model", "/m", "--port", "9023", "-x"]
    orchestrator = plans["orchestrator"].args
    assert orchestrator[orchestrator.index("--dit") + 1] == "127.0.0.1:9002"
    assert "--vae=127.0.0.1:9003,127.0.0.1:9013,127.0.0.1:9023" in orchestrator
    assert cloned.replicas("vae") == ["vae", "vae-2", "vae-3"]
    with pytest.raises(ValueError, match="not stages"):
        with_replicas(declared.compose, {"orchestrator": 2})
