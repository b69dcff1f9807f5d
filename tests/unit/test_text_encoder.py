"""Prompt encoding matches WanPipeline's; the embedding cache is an LRU bounded in bytes and entries, split by
an opaque per-tenant namespace; the stage bounds every field of EncodeRequest and names each text's tensors as
the DiT takes them, which the orchestrator relays untouched."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from families.qwen_image.encode import QwenPromptEncoder
from families.registry import family_named
from families.wan.encode import WanPromptEncoder
from services.checkpoint import read_checkpoint
from services.orchestrator.cache_namespace import cache_namespace_key, tenant_cache_namespace
from services.orchestrator.job import Job
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.routes import ModelRoute
from services.orchestrator.stage_clients import STAGE_ORDER, StagePool
from services.stage import StageControlServicer, StageRuntime
from services.torch_wire import to_torch
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import generation_pb2, stages_pb2, stages_pb2_grpc
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import EmbeddingCache, entry_bytes
from text_encoder_svc import service as text_encoder_service
from text_encoder_svc.config import EmbeddingCacheConfig
from text_encoder_svc.service import MAX_CACHE_NAMESPACE_BYTES, TextEncoderServicer


def test_embeddings_equal_wan_pipeline(tiny_model, reference_pipeline) -> None:
    encoder = WanPromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32)
    prompt, negative = "  a red   fox &amp; a hare ", "blurry"
    with torch.no_grad():  # as inside WanPipeline.__call__, which picks the same attention kernel
        expected_prompt, expected_negative = reference_pipeline.encode_prompt(
            prompt, negative, do_classifier_free_guidance=True, max_sequence_length=512
        )
    batched, cached = encoder.encode([prompt, negative], 512)
    assert not cached and list(batched) == ["embeds"]
    embeds = batched["embeds"]
    assert torch.equal(embeds[0], expected_prompt[0]) and torch.equal(embeds[1], expected_negative[0])
    assert embeds.shape == (2, 512, encoder.hidden_size)


def test_repeated_texts_come_from_the_cache(tiny_model) -> None:
    encoder = WanPromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32, cache_entries=8)
    first, hit = encoder.encode(["a fox", "blurry"], 64)
    assert not hit and encoder.cache.misses == 2
    again, hit = encoder.encode(["a fox", "blurry"], 64)
    assert hit and encoder.cache.hits == 2 and torch.equal(first["embeds"], again["embeds"])
    # The max length is part of the key.
    _, hit = encoder.encode(["a fox"], 32)
    assert not hit


def test_namespaces_never_share_entries(tiny_model) -> None:
    encoder = WanPromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32)
    first, hit = encoder.encode(["a fox"], 64, namespace=b"tenant-a")
    assert not hit
    # The same text from another namespace is computed again, with the same result.
    second, hit = encoder.encode(["a fox"], 64, namespace=b"tenant-b")
    assert not hit and encoder.cache.misses == 2 and encoder.cache.hits == 0
    assert torch.equal(first["embeds"], second["embeds"])
    # Requests without a namespace share the empty one, apart from both.
    _, hit = encoder.encode(["a fox"], 64)
    assert not hit and encoder.cache.misses == 3
    # Within a namespace the text hits.
    _, hit = encoder.encode(["a fox"], 64, namespace=b"tenant-a")
    assert hit and encoder.cache.hits == 1
    assert len(encoder.cache) == 3


def _key(text: str) -> tuple[bytes, str, str, int]:
    return (b"ns", "m", text, 8)


def test_cache_evicts_the_least_recently_used() -> None:
    cache = EmbeddingCache(max_entries=2)
    a, b, c = (torch.full((1,), float(i)) for i in range(3))
    cache.put(_key("a"), a)
    cache.put(_key("b"), b)
    assert cache.get(_key("a")) is a  # a is now the most recent
    cache.put(_key("c"), c)
    assert cache.get(_key("b")) is None
    assert cache.get(_key("a")) is a and cache.get(_key("c")) is c
    assert len(cache) == 2


def test_cache_bytes_never_exceed_the_budget() -> None:
    size = entry_bytes(_key("a"), torch.zeros(256))
    cache = EmbeddingCache(max_bytes=2 * size + size // 2)
    tensors = {text: torch.full((256,), float(i)) for i, text in enumerate("abc")}
    cache.put(_key("a"), tensors["a"])
    cache.put(_key("b"), tensors["b"])
    assert cache.total_bytes == 2 * size
    assert cache.get(_key("a")) is tensors["a"]  # b is now the least recently used
    cache.put(_key("c"), tensors["c"])  # three do not fit: b goes
    assert cache.get(_key("b")) is None
    assert cache.get(_key("a")) is tensors["a"] and cache.get(_key("c")) is tensors["c"]
    assert cache.total_bytes == 2 * size <= cache.max_bytes
    # Entries of every size, many more than fit: the total stays within the budget and equals what is kept.
    kept: dict[str, torch.Tensor] = {}
    for i in range(40):
        text = f"t{i}"
        kept[text] = torch.zeros(32 * (1 + i % 9))
        cache.put(_key(text), kept[text])
        assert cache.total_bytes <= cache.max_bytes
    held = [text for text in kept if cache.get(_key(text)) is not None]
    assert cache.total_bytes == sum(entry_bytes(_key(text), kept[text]) for text in held)
    assert "t39" in held and "t0" not in held


def test_an_entry_larger_than_the_budget_is_not_cached() -> None:
    size = entry_bytes(_key("a"), torch.zeros(256))
    cache = EmbeddingCache(max_bytes=2 * size)
    small = torch.zeros(256)
    cache.put(_key("small"), small)
    cache.put(_key("large"), torch.zeros(1024))
    assert cache.get(_key("large")) is None and cache.get(_key("small")) is small
    # A view keeps its whole storage alive, and is counted as such: one row of a large tensor does not fit.
    view = torch.zeros(4, 256)[:1]
    assert entry_bytes(_key("view"), view) > cache.max_bytes
    cache.put(_key("view"), view)
    assert cache.get(_key("view")) is None and cache.total_bytes == entry_bytes(_key("small"), small)


@pytest.mark.parametrize(("max_bytes", "max_entries"), [(0, 8), (2**20, 0)])
def test_a_zero_bound_disables_the_cache(max_bytes: int, max_entries: int) -> None:
    cache = EmbeddingCache(max_bytes=max_bytes, max_entries=max_entries)
    cache.put(_key("a"), torch.zeros(1))
    assert cache.get(_key("a")) is None and len(cache) == 0 and cache.total_bytes == 0


def test_tenant_namespaces_differ_per_tenant_and_are_stable_for_a_secret() -> None:
    key = cache_namespace_key("cluster-secret")
    acme, globex = tenant_cache_namespace(key, "acme"), tenant_cache_namespace(key, "globex")
    assert acme != globex
    assert len(acme) == 32 <= MAX_CACHE_NAMESPACE_BYTES
    # The same secret gives the same namespaces after a restart; another secret gives others.
    assert tenant_cache_namespace(cache_namespace_key("cluster-secret"), "acme") == acme
    assert tenant_cache_namespace(cache_namespace_key("another-secret"), "acme") != acme
    # The key is not the secret itself, which the stages hold.
    assert key != b"cluster-secret" and b"acme" not in acme
    # Without a secret each orchestrator draws its own key.
    assert cache_namespace_key(None) != cache_namespace_key(None)


def test_negative_cache_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--embedding-cache-bytes", "--embedding-cache-size"):
        with pytest.raises(SystemExit):
            text_encoder_service.main(["--model", "unused", flag, "-1"])
        assert f"{flag} -1: use 0 or more" in capsys.readouterr().err


async def _encode(
    stub: stages_pb2_grpc.TextEncoderStub, request: stages_pb2.EncodeRequest
) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors the stage sent, by name in the order sent, and whether it said they came from its cache."""
    assembler = TensorAssembler()
    tensors, hit = {}, False
    async for response in stub.Encode(request):
        hit = hit or response.cache_hit
        tensor = assembler.feed(response.tensor)
        if tensor is not None:
            tensors[tensor.name] = to_torch(tensor)
    assembler.finish()
    return tensors, hit


async def _refusal(stub: stages_pb2_grpc.TextEncoderStub, request: stages_pb2.EncodeRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _encode(stub, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    return caught.value


def test_service_bounds_fields_and_keeps_tenants_apart(tiny_model) -> None:
    """The stage on 127.0.0.1 with an ephemeral port, called directly and by the orchestrator's pipeline."""
    runtime = StageRuntime("text-encoder", read_checkpoint(tiny_model), torch.device("cpu"), torch.float32)
    cache = EmbeddingCacheConfig(max_bytes=DEFAULT_CACHE_BYTES, max_entries=DEFAULT_CACHE_ENTRIES)
    servicer = TextEncoderServicer(cache, runtime)
    servicer.load()
    cache = servicer.encoder.cache

    async def scenario() -> None:
        server = grpc.aio.server()
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        stages_pb2_grpc.add_StageControlServicer_to_server(StageControlServicer(runtime), server)
        servicer.add_to_server(server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        pool = StagePool({stage: endpoint for stage in STAGE_ORDER})
        try:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                stub = stages_pb2_grpc.TextEncoderStub(channel)
                # Every field is bounded, and a refusal names the field and its limit.
                error = await _refusal(
                    stub, stages_pb2.EncodeRequest(texts=["a"], cache_namespace=b"x" * (MAX_CACHE_NAMESPACE_BYTES + 1))
                )
                assert "cache_namespace" in error.details() and str(MAX_CACHE_NAMESPACE_BYTES) in error.details()
                error = await _refusal(stub, stages_pb2.EncodeRequest(texts=["a"], model="m" * 100_000))
                assert "model" in error.details() and "256" in error.details() and "m" * 300 not in error.details()
                error = await _refusal(stub, stages_pb2.EncodeRequest(texts=["a", "b", "c"]))
                assert "texts" in error.details() and "2" in error.details()
                assert cache.misses == 0  # nothing was encoded
                # Directly: a namespace as long as allowed is taken; namespaces never share a hit.
                longest = b"y" * MAX_CACHE_NAMESPACE_BYTES
                first, hit = await _encode(stub, stages_pb2.EncodeRequest(texts=["a fox"], cache_namespace=longest))
                assert not hit and list(first) == ["prompt_embeds"]
                second, hit = await _encode(stub, stages_pb2.EncodeRequest(texts=["a fox"], cache_namespace=b"other"))
                assert not hit and torch.equal(first["prompt_embeds"], second["prompt_embeds"])
                _, hit = await _encode(stub, stages_pb2.EncodeRequest(texts=["a fox"], cache_namespace=longest))
                assert hit
                # Each text's tensors are named as the DiT takes them: [1, L, dim] slices of the batched encoding.
                both, _ = await _encode(stub, stages_pb2.EncodeRequest(texts=["a fox", "blurry"]))
                assert list(both) == ["prompt_embeds", "negative_prompt_embeds"]
                batched, _ = servicer.encoder.encode(["a fox", "blurry"], runtime.spec.max_sequence_length)
                assert torch.equal(both["prompt_embeds"], batched["embeds"][:1])
                assert torch.equal(both["negative_prompt_embeds"], batched["embeds"][1:])
            # Through the orchestrator's pipeline: each tenant's requests carry their own namespace, and the
            # stage's chunks are kept as they came, to go to the DiT untouched.
            await pool.probe_all()
            pipeline = Pipeline(pool, cluster_secret="cluster-secret")
            family = family_named(runtime.spec.family)
            dit_info = stages_pb2.StageInfo(model=runtime.spec.model_id, family=family.name)
            route = ModelRoute(runtime.spec.model_id, dit_info, family)
            request = generation_pb2.GenerateRequest(prompt="a hare", guidance_scale=1.0)
            hits, misses = cache.hits, cache.misses
            conditioning = {}
            for i, tenant in enumerate(("acme", "globex", "acme")):
                job = Job(job_id=f"job-{i}", request=request, tenant=tenant)
                await pipeline.calls.encode(job, route)
                conditioning[tenant] = job.intermediates["outputs"]["text-encoder"]
            assert (cache.hits - hits, cache.misses - misses) == (1, 2)  # only acme's second request hit
            assert conditioning["acme"] == conditioning["globex"]
            assert [c.header.name for c in conditioning["acme"] if c.HasField("header")] == ["prompt_embeds"]
        finally:
            await pool.close()
            await server.stop(None)

    try:
        asyncio.run(scenario())
    finally:
        runtime.executor.shutdown(wait=False)


LONG_PROMPT = "a red fox runs through the snow at dawn, " * 40


def test_wan_truncation_counts_the_tokens_the_pipeline_cuts(tiny_model) -> None:
    """The count is the text's whole token sequence, of which WanPipeline's tokenizer call keeps the first
    max_sequence_length; a text that fits is not cut."""
    encoder = WanPromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32)
    cut = encoder.truncation(LONG_PROMPT, 64)
    assert cut is not None and cut.kept == 64
    whole = encoder.embed_many([LONG_PROMPT], cut.given + 100, pad_to_longest=True)
    assert whole.shape[1] == cut.given  # every token, the end token included
    assert encoder.truncation(LONG_PROMPT, cut.given) is None and encoder.truncation("a fox", 64) is None


def test_qwen_truncation_counts_the_tokens_the_pipeline_cuts(qwen_model) -> None:
    encoder = QwenPromptEncoder(qwen_model, "qwen", torch.device("cpu"), torch.float32)
    cut = encoder.truncation(LONG_PROMPT, 32)
    assert cut is not None and cut.kept == 32 and encoder.embed_uncached(LONG_PROMPT, 32).shape[0] == 32
    assert encoder.embed_uncached(LONG_PROMPT, cut.given + 100).shape[0] == cut.given
    assert encoder.truncation(LONG_PROMPT, cut.given) is None


def test_a_cut_text_is_reported_and_becomes_the_jobs_notice(tiny_model) -> None:
    """The stage's first response names each text it cut; the orchestrator adds them to the job once, however
    often the stage runs for it."""
    runtime = StageRuntime("text-encoder", read_checkpoint(tiny_model), torch.device("cpu"), torch.float32)
    servicer = TextEncoderServicer(EmbeddingCacheConfig(max_bytes=0, max_entries=0), runtime)
    servicer.load()

    async def scenario() -> Job:
        server = grpc.aio.server()
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        stages_pb2_grpc.add_StageControlServicer_to_server(StageControlServicer(runtime), server)
        servicer.add_to_server(server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        pool = StagePool({stage: endpoint for stage in STAGE_ORDER})
        try:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                stub = stages_pb2_grpc.TextEncoderStub(channel)
                short = [response async for response in stub.Encode(stages_pb2.EncodeRequest(texts=["a fox"]))]
                assert not any(response.notices for response in short)
            await pool.probe_all()
            pipeline = Pipeline(pool, cluster_secret="cluster-secret")
            route = ModelRoute(
                runtime.spec.model_id,
                stages_pb2.StageInfo(model=runtime.spec.model_id, family=runtime.spec.family),
                family_named(runtime.spec.family),
            )
            request = generation_pb2.GenerateRequest(prompt=LONG_PROMPT, negative_prompt=LONG_PROMPT, guidance_scale=5)
            job = Job(job_id="job", request=request)
            for _ in range(2):  # a retry of the stage reports the same cuts
                await pipeline.calls.encode(job, route)
            return job
        finally:
            await pool.close()
            await server.stop(None)

    try:
        job = asyncio.run(scenario())
    finally:
        runtime.executor.shutdown(wait=False)
    given = servicer.encoder.truncation(LONG_PROMPT, 512).given
    assert [(n.field, n.given, n.used, n.source) for n in job.notices] == [
        ("prompt", f"{given} tokens", "512 tokens", "text-encoder"),
        ("negative_prompt", f"{given} tokens", "512 tokens", "text-encoder"),
    ]
    assert job.notices[0].message.startswith(f"the prompt was truncated to 512 tokens ({given} given)")
    assert list(job.to_proto().notices) == job.notices


def test_qwen_texts_answer_with_their_masks(qwen_model) -> None:
    """Qwen-Image's texts keep their own length: each text's embeddings come with its mask, named for the DiT."""
    runtime = StageRuntime("text-encoder", read_checkpoint(qwen_model), torch.device("cpu"), torch.float32)
    cache = EmbeddingCacheConfig(max_bytes=DEFAULT_CACHE_BYTES, max_entries=DEFAULT_CACHE_ENTRIES)
    servicer = TextEncoderServicer(cache, runtime)
    servicer.load()
    texts = ["a red fox runs through the snow at dawn", "blurry"]

    async def scenario() -> dict[str, torch.Tensor]:
        server = grpc.aio.server()
        servicer.add_to_server(server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                tensors, _ = await _encode(
                    stages_pb2_grpc.TextEncoderStub(channel), stages_pb2.EncodeRequest(texts=texts)
                )
        finally:
            await server.stop(None)
        return tensors

    try:
        tensors = asyncio.run(scenario())
    finally:
        runtime.executor.shutdown(wait=False)
    names = ["prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"]
    assert list(tensors) == names
    batched, _ = servicer.encoder.encode(texts, runtime.spec.max_sequence_length)
    for i, role in enumerate(("prompt", "negative_prompt")):
        assert torch.equal(tensors[f"{role}_embeds"], batched["embeds"][i : i + 1])
        assert torch.equal(tensors[f"{role}_embeds_mask"], batched["embeds_mask"][i : i + 1])
        assert tensors[f"{role}_embeds_mask"].dtype == torch.int64
    assert tensors["prompt_embeds_mask"].sum() > tensors["negative_prompt_embeds_mask"].sum() > 0
