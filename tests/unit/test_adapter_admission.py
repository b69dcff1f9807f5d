"""Adapters and batch partners: a request's adapters are checked against the DiT's adapter cache before any stage
runs; each tenant names a bounded number of distinct adapters per minute; with --batch-per-tenant the DiT
batches a tenant's requests only with its own; and a batch holds no more work than one admitted request alone.

The orchestrator runs against the fake stages of tests/unit/test_tenant_errors.py (`Cluster`); the batcher runs with
a fake compute thread, as in tests/integration/test_batching.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from dit_svc.batching import RequestBatcher, checked_batch_group, max_work, request_work
from dit_svc.denoise import batch_key, make_adapter_cache
from dit_svc.lora import LoraSettings, list_adapters
from dit_svc.model_options import ModelOptions
from dit_svc.step_cache import CachePasses
from families.wan.denoise import WanDenoiser
from services.orchestrator.adapter_rate import WINDOW_S, AdapterRate
from services.orchestrator.options import batch_per_tenant, build_parser
from services.orchestrator.tenants import LimitExceeded, RateLimited, Tenant, TenantConfigError, TenantRegistry
from stagediff.status_details import retry_after
from stagediff.v1 import stages_pb2
from stagekit.denoise import DenoiseSpec
from stagekit.errors import RequestError
from tests.helpers.fake_cluster import Cluster
from tests.helpers.fake_stages import LIMITS
from tests.helpers.lora_adapters import wan_adapter

# The DiT holds 800 bytes of adapters: "big" and "small" fit alone, not together.
DIT_LIMITS = stages_pb2.ModelLimits()
DIT_LIMITS.CopyFrom(LIMITS)
DIT_LIMITS.max_loras = 2
DIT_LIMITS.lora_cache_bytes = 800
DIT_LIMITS.loras.extend(
    [
        stages_pb2.LoraInfo(name="big", bytes=1200, load_bytes=600),
        stages_pb2.LoraInfo(name="small", bytes=600, load_bytes=300),
        stages_pb2.LoraInfo(name="other", bytes=600, load_bytes=300),
    ]
)


def _loras(*names: str) -> list[stages_pb2.LoraAdapter]:
    return [stages_pb2.LoraAdapter(name=name) for name in names]


# ------------------------------------------------------------------------------------- the adapter cache --


def test_adapters_that_do_not_fit_the_dit_cache_are_refused_before_any_stage_runs(tmp_path) -> None:
    async def scenario():
        async with Cluster(tmp_path, DIT_LIMITS) as cluster:
            refused = await cluster.generate("acme", loras=_loras("big", "small"))
            calls = cluster.text_encoder.calls, len(cluster.denoiser.params)
            accepted = await cluster.generate("acme", loras=_loras("big"))
            return refused, calls, accepted

    refused, calls_when_refused, accepted = asyncio.run(scenario())
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loras: big, small take 900 bytes loaded" in refused.details() and "800" in refused.details()
    assert calls_when_refused == (0, 0), "no stage ran for the refused request"
    assert accepted is None, accepted and accepted.details()


def test_the_dit_lists_the_bytes_each_adapter_takes_loaded_as_its_cache_counts_them(tiny_model, tmp_path) -> None:
    wan_adapter(tiny_model, tmp_path / "a.safetensors", seed=0)
    options = ModelOptions(lora=LoraSettings(directory=tmp_path, pipeline="WanPipeline"))
    denoiser = WanDenoiser(tiny_model, torch.device("cpu"), torch.float32, options=options)
    cache = make_adapter_cache(denoiser, options)
    cache.prepare((("a", 1.0),))
    (listed,) = list_adapters(tmp_path, torch.float32.itemsize)
    assert listed.load_bytes == cache.loaded_bytes > 0
    assert list_adapters(tmp_path, torch.bfloat16.itemsize)[0].load_bytes == cache.loaded_bytes // 2


# ------------------------------------------------------------------------------- distinct adapters a minute --


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_names_a_bounded_number_of_distinct_adapters_per_minute() -> None:
    clock = Clock()
    rate = AdapterRate(default_per_minute=2, clock=clock)
    acme, globex = Tenant(name="acme"), Tenant(name="globex")
    rate.take(acme, ["a"])
    clock.now += 10
    rate.take(acme, ["b", "a"])
    rate.take(acme, ["a"])  # naming one again is free
    with pytest.raises(RateLimited) as refused:
        rate.take(acme, ["c"])
    # "a" was named again at +10 s, so "b" and "a" both stay in the window until +70 s.
    assert refused.value.retry_after == pytest.approx(WINDOW_S)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 per minute" in refused.value.message
    rate.take(globex, ["c", "d"])  # another tenant's bound is its own
    clock.now += WINDOW_S
    rate.take(acme, ["c"])
    with pytest.raises(LimitExceeded, match="3 distinct adapters exceed"):
        rate.take(acme, ["x", "y", "z"])
    unbounded = AdapterRate(default_per_minute=0, clock=clock)
    for name in "abcdefgh":
        unbounded.take(acme, [name])


def test_the_tenants_file_sets_a_tenants_bound_and_refusals_carry_retry_info(tmp_path) -> None:
    async def scenario():
        async with Cluster(tmp_path, DIT_LIMITS, adapters_per_minute=1) as cluster:
            first = await cluster.generate("acme", loras=_loras("small"))
            again = await cluster.generate("acme", loras=_loras("small"))
            refused = await cluster.generate("acme", loras=_loras("other"))
            admin = await cluster.generate("ops", loras=_loras("other"))  # the default bound: 12
            return first, again, refused, admin, cluster.text_encoder.calls

    first, again, refused, admin, encodes = asyncio.run(scenario())
    assert first is None and again is None and admin is None
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "limit is 1 per minute" in refused.details()
    assert 0 < retry_after(refused) <= WINDOW_S
    assert encodes == 3, "the refused request ran no stage"
    with pytest.raises(TenantConfigError, match="adapters_per_minute"):
        TenantRegistry.from_dict(
            {"tenants": [{"name": "a", "api_keys": ["sha256:" + "0" * 64], "quotas": {"adapters_per_minute": 0}}]}
        )


# ------------------------------------------------------------------------------------ one tenant a batch --


def test_batch_per_tenant_is_on_with_a_tenants_file_unless_turned_off() -> None:
    parse = build_parser().parse_args
    assert batch_per_tenant(parse([]).batch_per_tenant, has_tenants=True)
    assert not batch_per_tenant(parse([]).batch_per_tenant, has_tenants=False)
    assert not batch_per_tenant(parse(["--no-batch-per-tenant"]).batch_per_tenant, has_tenants=True)
    assert batch_per_tenant(parse(["--batch-per-tenant"]).batch_per_tenant, has_tenants=False)


@pytest.mark.parametrize("per_tenant", [True, False])
def test_the_dit_gets_one_opaque_batch_group_per_tenant(tmp_path, per_tenant: bool) -> None:
    async def scenario():
        async with Cluster(tmp_path, batch_per_tenant=per_tenant) as cluster:
            for tenant in ("acme", "acme", "ops"):
                assert await cluster.generate(tenant) is None
            return [params.batch_group for params in cluster.denoiser.params]

    first, second, other = asyncio.run(scenario())
    if per_tenant:
        assert first == second and first != other and len(first) == 32
        assert b"acme" not in first, "the DiT never learns the tenant's name"
    else:
        assert first == second == other == b""


def test_requests_of_different_batch_groups_never_share_a_batch() -> None:
    spec = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=0)
    conditioning = {"prompt_embeds": torch.zeros(1, 24, 16)}
    ours, theirs = (dataclasses.replace(spec, batch_group=group) for group in (b"a" * 32, b"b" * 32))
    assert batch_key(ours, conditioning) == batch_key(dataclasses.replace(ours, seed=7), conditioning)
    assert batch_key(ours, conditioning) != batch_key(theirs, conditioning)
    assert checked_batch_group(b"x" * 64) == b"x" * 64
    with pytest.raises(RequestError, match="batch_group: 65 bytes"):
        checked_batch_group(b"x" * 65)


# ---------------------------------------------------------------------------------------- a batch's size --


class _ComputeThread:
    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


def test_a_batch_holds_no_more_work_than_the_largest_request_alone() -> None:
    spec = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=1, guidance_scale=4.0, seed=0)
    batches: list[list[int]] = []

    def run_batch(specs, conditionings, on_step, wanted):
        batches.append([s.seed for s in specs])
        return [(torch.zeros(1), CachePasses(run=1)) for _ in specs]

    async def requests(work_limit: int):
        batcher = RequestBatcher(_ComputeThread(), run_batch, max_batch_size=8, wait_ms=300, work_limit=work_limit)

        async def one(seed: int):
            return [item async for item in batcher.stream(dataclasses.replace(spec, seed=seed), {}, ("key",))]

        await asyncio.gather(*(one(seed) for seed in range(5)))

    asyncio.run(requests(work_limit=2 * request_work(spec)))
    assert sorted(batches) == [[0, 1], [2, 3], [4]]
    batches.clear()
    asyncio.run(requests(work_limit=request_work(spec) // 2))  # larger than the bound alone: runs alone
    assert sorted(batches) == [[0], [1], [2], [3], [4]]
    largest = DenoiseSpec(
        height=LIMITS.max_height,
        width=LIMITS.max_width,
        num_frames=LIMITS.max_frames,
        num_inference_steps=1,
        guidance_scale=4.0,
        seed=0,
    )
    assert request_work(largest) == max_work(LIMITS)
