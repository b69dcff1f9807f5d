"""A stage's replicas from looked-up names (services/orchestrator/discovery.py), reconciled every probe
interval: a name's new address joins the pool and takes calls, one gone takes no new call but finishes the
call it has, and a failed lookup changes nothing. The lookup is injected; the replicas are small real servers."""

from __future__ import annotations

import asyncio

import pytest

from services.metrics import OrchestratorMetrics
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.discovery import MAX_REPLICAS_PER_STAGE, StageSources, endpoint_of
from services.orchestrator.stage_clients import StagePool
from stagediff.v1 import stages_pb2
from tests.helpers.fake_replicas import eventually, replicas
from tests.helpers.serving import parse_serve


class Names:
    """A lookup under the test's control: each name's addresses, or an outage."""

    def __init__(self, **addresses: list[str]) -> None:
        self.addresses = addresses
        self.down = False

    def __call__(self, name: str, port: int) -> list[str]:
        if self.down:
            raise OSError("Temporary failure in name resolution")
        return list(self.addresses[name])


def _series(metrics: OrchestratorMetrics, endpoint: str) -> list[str]:
    return [
        sample.name
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.labels.get("replica") == endpoint
    ]


def test_looked_up_replicas_join_take_calls_and_leave_after_their_calls() -> None:
    async def scenario() -> None:
        async with replicas(2) as (first, second):
            for fake in (first, second):
                fake.encode_code = None
            names = Names(first=["127.0.0.1"], second=[])
            metrics = OrchestratorMetrics()
            flag = f"dns:first:{first.port},dns:second:{second.port}"
            pool = StagePool({"text-encoder": flag}, probe_interval_s=0.05, metrics=metrics, lookup=names)
            stage = pool["text-encoder"]
            pool.start_probing()
            try:
                await eventually(lambda: [r.endpoint for r in stage.serving()] == [first.endpoint], "first serves")
                # A new address of a name: it joins, and the next call goes to it (the first is busy).
                names.addresses["second"] = ["127.0.0.1"]
                await eventually(lambda: len(stage.serving()) == 2, "the second replica serves")
                async with stage.acquire() as busy, stage.acquire() as other:
                    assert {busy.endpoint, other.endpoint} == {first.endpoint, second.endpoint}
                # An address gone while it has a call: no new call goes to it, and its call ends normally.
                async with stage.acquire() as held:
                    leaving = held.endpoint
                    names.addresses["first" if leaving == first.endpoint else "second"] = []
                    await eventually(lambda: held not in stage.replicas and held in stage.retiring, "it retires")
                    for _ in range(3):
                        async with stage.acquire() as replica:
                            assert replica is not held
                    responses = [r async for r in held.text_encoder.Encode(stages_pb2.EncodeRequest(texts=["x"]))]
                    assert len(responses) == 1
                await eventually(lambda: not stage.retiring, "the retired replica is closed once its call ended")
                assert _series(metrics, leaving) == [], "a retired replica's series stay"
                # A failed lookup leaves the pool as it was.
                names.down = True
                kept = list(stage.replicas)
                await pool.discover()
                assert stage.replicas == kept
            finally:
                await pool.close()

    asyncio.run(scenario())


def test_a_name_with_no_address_yet_leaves_its_stage_empty_until_one_appears() -> None:
    async def scenario() -> None:
        async with replicas(1) as (fake,):
            names = Names(dit=[])
            pool = StagePool({"text-encoder": f"dns:dit:{fake.port}"}, probe_interval_s=0.05, lookup=names)
            stage = pool["text-encoder"]
            assert stage.replicas == [] and stage.endpoint == f"dns:dit:{fake.port}"
            pool.start_probing()
            try:
                names.addresses["dit"] = ["127.0.0.1"]
                await asyncio.wait_for(stage.wait_serving(), 30)
            finally:
                await pool.close()

    asyncio.run(scenario())


def test_sources_parse_and_bound() -> None:
    sources = StageSources.parse("dit", "a:1, dns:dit-headless.ns.svc:50062")
    assert sources.endpoints == ("a:1",) and sources.names == (("dit-headless.ns.svc", 50062),)
    assert endpoint_of("fd00::1", 5) == "[fd00::1]:5" and endpoint_of("10.0.0.1", 5) == "10.0.0.1:5"
    many = Names(big=[f"10.0.{i // 256}.{i % 256}" for i in range(1000)])
    found = asyncio.run(StageSources.parse("dit", "a:1,dns:big:1").resolve(many))
    assert len(found) == MAX_REPLICAS_PER_STAGE and found["a:1"] is None and found["10.0.0.0:1"] == "big"
    for bad in ("dns:dit", "dns::50062", "dns:dit:0", "dns:dit:port"):
        args = parse_serve(["orchestrator", "--dit", bad, "--text-encoder", "t:1", "--vae", "v:1"])
        with pytest.raises(ValueError, match=rf"--dit {bad}: write a looked-up name as dns:NAME:PORT"):
            OrchestratorConfig.from_options(args)
