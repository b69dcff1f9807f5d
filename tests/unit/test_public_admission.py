"""The public API against hostile input, on a real GenerationServicer with fake stages.

Every string and repeated field is bounded before use; refused requests reach the metrics with bounded
label values only; quotas count what a job produces (after interpolation); cluster info is for operators
and comes from cached probes; a lost Generate stream leaves its job running for a grace period so the
client's retry can attach again, while an explicit cancel stops it at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.orchestrator.job import JobState
from services.orchestrator.request_bounds import FIELD_LIMITS, sized_fields
from services.orchestrator.service import MAX_REQUEST_BYTES
from services.orchestrator.servicer import UNKNOWN_MODEL_LABEL
from services.orchestrator.tenants import (
    DEFAULT_MAX_OUTPUT_FRAMES,
    LimitExceeded,
    TenantRegistry,
    hash_api_key,
    new_api_key,
)
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.fake_orchestrator import GENERATION, GRACE_S, Orchestrator
from tests.helpers.grpc_channels import assert_status

KEYS = {"operator": new_api_key(), "customer": new_api_key()}


@pytest.fixture
def orchestrator(tmp_path: Path) -> Iterator[Orchestrator]:
    tenants = TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "operator", "api_keys": [hash_api_key(KEYS["operator"])], "admin": True},
                {
                    "name": "customer",
                    "api_keys": [hash_api_key(KEYS["customer"])],
                    "quotas": {"max_frames": 33, "max_watch_streams": 2},
                },
            ]
        }
    )
    server = Orchestrator(tmp_path / "state", tenants)
    yield server
    server.stop()


def _stub(server: Orchestrator) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 64 << 20)])
    return channel, generation_pb2_grpc.GenerationStub(channel)


def _auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def test_every_string_and_repeated_field_of_every_public_request_has_a_limit() -> None:
    for method in GENERATION.methods:
        for path, field in sized_fields(method.input_type):
            assert field.name in FIELD_LIMITS.get(field.containing_type.full_name, {}), (
                f"{method.name}: {path} has no length limit in services/orchestrator/request_bounds.py"
            )


def _oversized_requests() -> Iterator[tuple[str, str, object]]:
    """(method, field path, request) with one field one past its limit, for every bounded field."""
    for method in GENERATION.methods:
        for path, field in sized_fields(method.input_type):
            request = method.input_type._concrete_class()
            if "prompt" in method.input_type.fields_by_name:
                request.prompt = "a fox"
            *parents, name = path.split(".")
            target = request
            for parent in parents:
                target = getattr(target, parent)
            limit = FIELD_LIMITS[field.containing_type.full_name][name]
            if field.is_repeated:  # one entry too many (input images)
                getattr(target, name).extend(field.message_type._concrete_class() for _ in range(limit + 1))
            else:
                setattr(target, name, (b"x" if field.type == field.TYPE_BYTES else "x") * (limit + 1))
            yield method.name, path, request


def test_each_field_over_its_limit_is_refused_naming_the_field(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    checked = []
    with channel:
        for method, path, request in _oversized_requests():
            with pytest.raises(grpc.RpcError) as raised:
                streamed = GENERATION.methods_by_name[method].client_streaming
                result = getattr(stub, method)(
                    iter([request]) if streamed else request, metadata=_auth("operator"), timeout=10
                )
                if method in ("Generate", "WatchJob"):
                    list(result)
            assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, path, "at most")
            assert "xxxx" not in raised.value.details(), "the refusal echoed the value"
            checked.append(f"{method}.{path}")
    assert "Generate.interpolation.model_path" in checked and "CancelJob.job_id" in checked
    assert "Submit.images" in checked
    assert not orchestrator.store.list_jobs(), "a refused request became a job"


def test_refused_models_reach_the_metrics_as_a_fixed_label(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    with channel:
        for index in range(6):
            # Longer than any model id: refused before the lookup, naming the field.
            with pytest.raises(grpc.RpcError) as raised:
                stub.Submit(
                    generation_pb2.GenerateRequest(model=f"{index}" * (1 << 20), prompt="a fox"),
                    metadata=_auth("customer"),
                )
            assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, "model", "at most 128")
            # A short model id that is not served: NOT_FOUND, counted as 'unknown'.
            with pytest.raises(grpc.RpcError) as raised:
                stub.Submit(
                    generation_pb2.GenerateRequest(model=f"no-such-{index}", prompt="a fox"), metadata=_auth("customer")
                )
            assert_status(raised.value, grpc.StatusCode.NOT_FOUND, f"no-such-{index}")
    models = set()
    for metric in orchestrator.metrics.registry.collect():
        for sample in metric.samples:
            for value in sample.labels.values():
                assert len(value) <= 64, f"{metric.name} has a label value of {len(value)} characters"
            models.add(sample.labels.get("model"))
    assert UNKNOWN_MODEL_LABEL in models and not any(str(m).startswith("no-such") for m in models)


def test_a_message_over_the_public_limit_is_refused_before_it_is_parsed(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    with channel, pytest.raises(grpc.RpcError) as raised:
        stub.Submit(
            generation_pb2.GenerateRequest(prompt="a fox", model="m" * (MAX_REQUEST_BYTES + 1)),
            metadata=_auth("operator"),
        )
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not orchestrator.store.list_jobs()


def test_ignored_and_unknown_fields_are_not_stored(orchestrator: Orchestrator) -> None:
    request = generation_pb2.GenerateRequest(prompt="a fox", request_id="r1")
    request.interpolation.model_path = "/x" * 1000  # ignored: interpolation is off
    # Field 999 is unknown to the server: bytes a client added, which must not be kept or echoed.
    data = request.SerializeToString() + b"\xba\x3e\x08" + b"unknown!"
    channel, _ = _stub(orchestrator)
    with channel:
        submit = channel.unary_unary(
            "/stagediff.v1.Generation/Submit",
            request_serializer=lambda raw: raw,
            response_deserializer=generation_pb2.Job.FromString,
        )
        job = submit(data, metadata=_auth("customer"))
    assert not job.request.HasField("interpolation") and b"unknown!" not in job.request.SerializeToString()
    stored = orchestrator.store.get(job.job_id)
    assert b"unknown!" not in stored.request and b"/x/x" not in stored.request


def _request(num_frames: int, exp: int, height: int = 32, width: int = 32) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        prompt="p", height=height, width=width, num_frames=num_frames, num_inference_steps=2
    )
    if exp:
        request.interpolation.enable = True
        request.interpolation.exp = exp
    return request


def test_quotas_count_frames_after_interpolation() -> None:
    registry = TenantRegistry.from_dict(
        {
            "tenants": [
                {
                    "name": "t",
                    "api_keys": [hash_api_key(new_api_key())],
                    "quotas": {"max_frames": 33, "max_output_frames": 65},
                }
            ]
        }
    )
    tenant = registry.tenants["t"]
    registry.check_request_limits(tenant, _request(33, 1))  # 65 frames out
    with pytest.raises(LimitExceeded) as raised:
        registry.check_request_limits(tenant, _request(33, 4))  # 513 frames out
    assert raised.value.field == "output frames" and raised.value.value == 513 and raised.value.limit == 65
    assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED and "interpolation.exp 4" in raised.value.message


def test_the_open_tenant_has_output_limits_by_default() -> None:
    registry = TenantRegistry.open()
    tenant = registry.open_tenant
    registry.check_request_limits(tenant, _request(65, 4))  # 1025 frames: the default limit
    with pytest.raises(LimitExceeded) as raised:
        registry.check_request_limits(tenant, _request(81, 4))  # 1281 frames
    assert raised.value.limit == DEFAULT_MAX_OUTPUT_FRAMES
    with pytest.raises(LimitExceeded) as raised:
        registry.check_request_limits(tenant, _request(129, 2, height=1024, width=1024))  # 513 frames of 1 Mpx
    assert raised.value.field == "output pixels"


def test_an_output_quota_refuses_through_the_api(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    with channel, pytest.raises(grpc.RpcError) as raised:
        stub.Submit(_request(33, 4), metadata=_auth("customer"))  # 513 frames: within the default 1025
        stub.Submit(_request(81, 4), metadata=_auth("operator"))  # 1281 frames, with no quota in the file
    assert_status(raised.value, grpc.StatusCode.PERMISSION_DENIED, "output frames", "1025")


def test_cluster_info_is_for_admin_tenants_and_probes_nothing(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    with channel:
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetClusterInfo(generation_pb2.GetClusterInfoRequest(), metadata=_auth("customer"))
        assert_status(raised.value, grpc.StatusCode.PERMISSION_DENIED, "customer", "admin")
        info = stub.GetClusterInfo(generation_pb2.GetClusterInfoRequest(), metadata=_auth("operator"))
    assert [stage.info.stage for stage in info.stages] == ["text-encoder", "dit", "vae", "interp"]


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_a_lost_stream_keeps_its_job_for_the_grace_period_and_a_retry_attaches(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    request = generation_pb2.GenerateRequest(prompt="a fox", request_id="lost-1")
    with channel:
        stream = stub.Generate(request, metadata=_auth("customer"))
        job_id = next(stream).job_id
        stream.cancel()  # what the server sees of a dropped connection
        # Still running after twice the grace period, because the retry below attached within it.
        retry = stub.Generate(request, metadata=_auth("customer"))
        assert next(retry).job_id == job_id
        time.sleep(2 * GRACE_S)
        assert orchestrator.state(job_id) == JobState.JOB_STATE_RUNNING
        retry.cancel()
        # Nobody attaches again: cancelled once the grace period has passed.
        _wait_for(lambda: orchestrator.state(job_id) == JobState.JOB_STATE_CANCELLED, "the abandoned job's cancel")
    record = orchestrator.store.get(job_id)
    assert "did not attach again" in record.error_message


def test_cancel_job_stops_a_detached_job_at_once(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    request = generation_pb2.GenerateRequest(prompt="a fox", request_id="lost-2")
    with channel:
        stream = stub.Generate(request, metadata=_auth("customer"))
        job_id = next(stream).job_id
        stream.cancel()
        job = stub.CancelJob(generation_pb2.CancelJobRequest(job_id=job_id), metadata=_auth("customer"))
    assert job.state == JobState.JOB_STATE_CANCELLED


def test_a_stream_without_request_id_cancels_its_job_when_it_ends(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    with channel:
        stream = stub.Generate(generation_pb2.GenerateRequest(prompt="a fox"), metadata=_auth("customer"))
        job_id = next(stream).job_id
        stream.cancel()
        _wait_for(lambda: orchestrator.state(job_id) == JobState.JOB_STATE_CANCELLED, "the cancel")
    # Nothing could attach to it by request id: it was stopped when the stream ended, not after a grace period.
    assert orchestrator.store.get(job_id).error_message == "the client cancelled or disconnected"


def test_an_interpolation_model_path_not_served_is_refused_before_any_stage(orchestrator: Orchestrator) -> None:
    orchestrator.servicer.stages["interp"].info.weights_path = "/models/rife/flownet.pkl"
    request = _request(9, 1)
    request.interpolation.model_path = "/somewhere/else.pkl"
    channel, stub = _stub(orchestrator)
    with channel:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Submit(request, metadata=_auth("customer"))
        assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, "interpolation.model_path")
        assert "/models/rife" not in raised.value.details(), "a tenant learned where the weights live"
        assert not orchestrator.store.list_jobs()
        request.interpolation.model_path = "/models/rife/flownet.pkl"
        assert stub.Submit(request, metadata=_auth("customer")).request.interpolation.model_path


def test_a_tenant_holds_at_most_max_watch_streams_replays(orchestrator: Orchestrator) -> None:
    channel, stub = _stub(orchestrator)
    request = generation_pb2.GenerateRequest(prompt="a fox", request_id="watched")
    with channel:
        origin = stub.Generate(request, metadata=_auth("customer"))
        job_id = next(origin).job_id
        watch = generation_pb2.WatchJobRequest(job_id=job_id)
        first, second = (stub.WatchJob(watch, metadata=_auth("customer")) for _ in range(2))
        assert next(first).job_id == job_id and next(second).job_id == job_id
        # A third replay, by WatchJob or by a Generate retry that attaches, is refused with a retry delay.
        for third in (
            stub.WatchJob(watch, metadata=_auth("customer")),
            stub.Generate(request, metadata=_auth("customer")),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                next(third)
            assert_status(raised.value, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_watch_streams")
        # A closed stream frees its place.
        first.cancel()
        reopened = []

        def reopen() -> bool:
            stream = stub.WatchJob(watch, metadata=_auth("customer"))
            try:
                reopened.append(next(stream).job_id)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return True

        _wait_for(reopen, "a new WatchJob after one was closed")
        assert reopened == [job_id]
        origin.cancel()
