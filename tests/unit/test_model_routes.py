"""One orchestrator serves several models: each model's calls go to the replicas holding its components.

Fake stages serve on 127.0.0.1 and report StageInfo as real ones do (components by identity, the DiT's whole
checkpoint); the orchestrator's own GenerationServicer, Pipeline, JobManager and StagePool route between them.
Two Wan models share a text encoder and a VAE (the same identities); a Qwen-Image model has its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.orchestrator.tenants import TenantRegistry
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2
from tests.helpers.fake_stages import (
    LIMITS,
    ChainOrchestrator,
    FakeDenoiser,
    FakeTextEncoder,
    FakeVae,
    generate,
    generate_request,
    refusal,
    serve_stage,
)

UMT5 = {"text_encoder": "sha256:umt5", "tokenizer": "sha256:t5-tokenizer"}
QWEN_VL = {"text_encoder": "sha256:qwen2.5-vl", "tokenizer": "sha256:qwen-tokenizer", "processor": "sha256:qp"}
WAN_VAE, QWEN_VAE = {"vae": "sha256:wan-vae"}, {"vae": "sha256:qwen-vae"}


class Recording:
    """Remembers the model id each call named."""

    def __init__(self) -> None:
        self.models: list[str] = []


class RecordingTextEncoder(FakeTextEncoder, Recording):
    def __init__(self) -> None:
        FakeTextEncoder.__init__(self)
        Recording.__init__(self)

    async def Encode(self, request, context):
        self.models.append(request.model)
        async for response in super().Encode(request, context):
            yield response


class RecordingDenoiser(FakeDenoiser, Recording):
    def __init__(self) -> None:
        FakeDenoiser.__init__(self)
        Recording.__init__(self)

    async def Denoise(self, request_iterator, context):
        async def params_noted():
            async for request in request_iterator:
                if request.HasField("params"):
                    self.models.append(request.params.model)
                yield request

        async for response in super().Denoise(params_noted(), context):
            yield response


class RecordingVae(FakeVae, Recording):
    def __init__(self) -> None:
        FakeVae.__init__(self)
        Recording.__init__(self)

    async def Decode(self, request_iterator, context):
        async def params_noted():
            async for request in request_iterator:
                if request.HasField("params"):
                    self.models.append(request.params.model)
                yield request

        async for response in super().Decode(params_noted(), context):
            yield response


def _info(stage: str, model: str, family: str, components: dict, **fields) -> stages_pb2.StageInfo:
    limits = stages_pb2.ModelLimits()
    limits.CopyFrom(LIMITS)
    if family == "qwen-image":
        limits.default_num_frames = limits.temporal_factor = 1
    return stages_pb2.StageInfo(stage=stage, model=model, family=family, limits=limits, components=components, **fields)


def _dit(model: str, family: str, conditioning: dict, vae: dict) -> stages_pb2.StageInfo:
    transformer = {"transformer": f"sha256:{model}-transformer", "scheduler": "sha256:scheduler"}
    return _info(
        "dit", model, family, transformer, model_components={**conditioning, **vae, **transformer}, models=[model]
    )


class Cluster:
    """A text encoder and a VAE shared by the Wan models t2v and t2v-b, a DiT each, and Qwen-Image's own three."""

    def __init__(self) -> None:
        self.servicers = {
            "te-wan": RecordingTextEncoder(),
            "te-qwen": RecordingTextEncoder(),
            "dit-t2v": RecordingDenoiser(),
            "dit-t2v-b": RecordingDenoiser(),
            "dit-qwen": RecordingDenoiser(),
            "vae-wan": RecordingVae(),
            "vae-qwen": RecordingVae(),
        }
        self.infos = {
            "te-wan": _info("text-encoder", "t2v", "wan-t2v", UMT5, models=["t2v"]),
            "te-qwen": _info("text-encoder", "qwen", "qwen-image", QWEN_VL, models=["qwen"]),
            "dit-t2v": _dit("t2v", "wan-t2v", UMT5, WAN_VAE),
            "dit-t2v-b": _dit("t2v-b", "wan-t2v", UMT5, WAN_VAE),
            "dit-qwen": _dit("qwen", "qwen-image", QWEN_VL, QWEN_VAE),
            "vae-wan": _info("vae", "t2v", "wan-t2v", WAN_VAE, models=["t2v"]),
            "vae-qwen": _info("vae", "qwen", "qwen-image", QWEN_VAE, models=["qwen"]),
        }
        self.servers: list[grpc.aio.Server] = []
        self.endpoints: dict[str, list[str]] = {"text-encoder": [], "dit": [], "vae": []}

    async def start(self) -> Cluster:
        for name, servicer in self.servicers.items():
            info = self.infos[name]
            server, endpoint = await serve_stage(info.stage, servicer, info=info)
            self.servers.append(server)
            self.endpoints[info.stage].append(endpoint)
        return self

    def called(self) -> dict[str, list[str]]:
        """The model ids each fake was called with, for those called."""
        return {name: servicer.models for name, servicer in self.servicers.items() if servicer.models}

    async def stop(self) -> None:
        for server in self.servers:
            await server.stop(None)


TENANTS = """
tenants:
  - name: acme
    api_keys: ["sha256:{acme}"]
  - name: wan-only
    api_keys: ["sha256:{wan}"]
    models: ["t2v*"]
"""


def _tenants(tmp_path: Path) -> TenantRegistry:
    import hashlib

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS.format(acme=digest("acme-key"), wan=digest("wan-key")))
    return TenantRegistry.from_file(path)


def _as(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_each_model_runs_on_the_replicas_holding_its_components(tmp_path: Path) -> None:
    async def scenario() -> None:
        cluster = await Cluster().start()
        orchestrator = ChainOrchestrator(cluster.endpoints, tmp_path / "state", tenants=_tenants(tmp_path))
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            acme = _as("acme-key")
            for model in ("t2v", "t2v-b", "qwen"):
                frames = 1 if model == "qwen" else 9
                events = await generate(
                    orchestrator.endpoint, generate_request(model=model, num_frames=frames), metadata=acme
                )
                assert events[-1].HasField("completed"), events[-1]
            # The Wan models share the text encoder and the VAE, each named the id it serves; Qwen-Image has its own.
            assert cluster.called() == {
                "te-wan": ["t2v", "t2v"],
                "te-qwen": ["qwen"],
                "dit-t2v": ["t2v"],
                "dit-t2v-b": ["t2v-b"],
                "dit-qwen": ["qwen"],
                "vae-wan": ["t2v", "t2v"],
                "vae-qwen": ["qwen"],
            }
            # The job record carries its model.
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                jobs = (await stub.ListJobs(generation_pb2.ListJobsRequest(), metadata=acme)).jobs
                assert sorted(job.request.model for job in jobs) == ["qwen", "t2v", "t2v-b"]
                listed = (await stub.ListModels(generation_pb2.ListModelsRequest(), metadata=acme)).models
                assert [(m.id, m.family, dict(m.serving_replicas)) for m in listed] == [
                    ("t2v", "wan-t2v", {"text-encoder": 1, "dit": 1, "vae": 1}),
                    ("t2v-b", "wan-t2v", {"text-encoder": 1, "dit": 1, "vae": 1}),
                    ("qwen", "qwen-image", {"text-encoder": 1, "dit": 1, "vae": 1}),
                ]
                # A tenant allowed the Wan models sees those only, and is refused the other by name.
                wan = _as("wan-key")
                listed = (await stub.ListModels(generation_pb2.ListModelsRequest(), metadata=wan)).models
                assert [m.id for m in listed] == ["t2v", "t2v-b"]
            error = await refusal(orchestrator.endpoint, generate_request(model="qwen", num_frames=1), metadata=wan)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
            assert "'wan-only' may not use model 'qwen'" in error.details()
            # Several models: a request must name one, and is told which (those its tenant may use).
            error = await refusal(orchestrator.endpoint, generate_request(), metadata=wan)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert error.details() == "model: this cluster serves several models; name one of t2v, t2v-b"
            assert len(cluster.servicers["dit-qwen"].models) == 1, "the refused requests reached no stage"
        finally:
            await orchestrator.stop()
            await cluster.stop()

    asyncio.run(scenario())


def test_a_model_whose_components_no_replica_holds_fails_unavailable_naming_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        cluster = Cluster()
        # Qwen-Image's DiT alone: the Wan text encoder and VAE hold none of its components.
        del cluster.servicers["te-qwen"], cluster.servicers["vae-qwen"]
        await cluster.start()
        orchestrator = ChainOrchestrator(cluster.endpoints, tmp_path / "state", replica_wait_s=0.2)
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            error = await refusal(orchestrator.endpoint, generate_request(model="qwen", num_frames=1))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert "stage 'text-encoder'" in error.details(), error
            assert "no replica serving model 'qwen'" in error.details(), error
            assert "te-wan" not in cluster.called()
        finally:
            await orchestrator.stop()
            await cluster.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("model", ["t2v", "t2v-b"])
def test_a_call_names_the_model_id_its_replica_serves(model: str) -> None:
    from families.registry import FAMILIES
    from services.orchestrator.routes import ModelRoute

    cluster = Cluster()
    route = ModelRoute(model, cluster.infos[f"dit-{model}"], FAMILIES["wan-t2v"])
    text_encoder, qwen = cluster.infos["te-wan"], cluster.infos["te-qwen"]
    assert route.accepts("text-encoder", "encode")(text_encoder)
    assert not route.accepts("text-encoder", "encode")(qwen)
    assert route.model_for(text_encoder) == "t2v"  # the shared one serves t2v-b under its own id
    assert route.accepts("dit")(cluster.infos[f"dit-{model}"])
    assert not route.accepts("dit")(cluster.infos["dit-qwen"])
    # A replica that also serves the model's id is named that id.
    text_encoder.models.append("t2v-b")
    assert route.model_for(text_encoder) == model


def test_a_request_without_a_model_gets_the_one_a_dit_reported_not_one_known_from_the_store_alone() -> None:
    from types import SimpleNamespace

    from services.orchestrator.routes import ModelRoutes

    cluster = Cluster()
    routes = ModelRoutes()
    routes.remember(cluster.infos["dit-qwen"], "the job store")  # a model deployed before, known from the store
    assert routes.default(["qwen"]) == "qwen"  # the only one there is: its pool may be at zero
    routes.learn([SimpleNamespace(endpoint="dit:1", info=cluster.infos["dit-t2v"], serving=True)])
    assert routes.default(["qwen", "t2v"]) == "t2v"
    routes.learn([SimpleNamespace(endpoint="dit:2", info=cluster.infos["dit-t2v-b"], serving=False)])
    assert routes.default(["qwen", "t2v", "t2v-b"]) == ""  # two reported by DiTs: the request must name one
