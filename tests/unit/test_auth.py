"""Tenant keys on the public port, the cluster secret between services, and TLS, over real aio servers."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    ClusterSecretInterceptor,
    TLSConfigError,
    add_stage_tls_arguments,
    add_tls_arguments,
    cluster_channel,
    load_cluster_secret,
    server_credentials_for,
    stage_channel_credentials,
)
from services.orchestrator.tenant_auth import TenantAuthInterceptor, current_tenant
from services.orchestrator.tenants import TenantRegistry
from services.server_config import TlsConfig
from services.tracing import server_interceptor as tracing_server_interceptor
from tests.helpers.auth_servers import (
    KEY_ACME,
    KEY_BETA,
    SECRET,
    SERVICE,
    Echo,
    bearer,
    call,
    echo_server,
    registry,
    run,
)
from tests.helpers.grpc_channels import assert_status

KINDS = ("Unary", "ServerStream", "WriteStream", "ClientStream", "BidiStream")
EXPECTED = {
    "Unary": [b"{t}"],
    "ServerStream": [b"{t}", b"{t}"],
    "WriteStream": [b"{t}"],
    "ClientStream": [b"{t}/2"],
    "BidiStream": [b"{t}:a", b"{t}:b"],
}


def _expected(kind: str, tenant: str) -> list[bytes]:
    return [item.replace(b"{t}", tenant.encode()) for item in EXPECTED[kind]]


@pytest.mark.parametrize("kind", KINDS)
def test_the_right_key_reaches_the_handler_as_its_tenant(kind: str) -> None:
    async def scenario():
        echo = Echo()
        async with (
            echo_server(TenantAuthInterceptor(registry()), echo) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            return await call(channel, kind, bearer(KEY_ACME)), await call(channel, kind, bearer(KEY_BETA))

    as_acme, as_beta = run(scenario)
    assert as_acme == _expected(kind, "acme")
    assert as_beta == _expected(kind, "beta")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ((), ["missing API key", "authorization: Bearer"]),
        (bearer(KEY_ACME[:-1] + "X"), ["invalid API key"]),
        ((("authorization", KEY_ACME),), ["malformed"]),
    ],
)
def test_no_key_or_a_wrong_key_is_unauthenticated_before_the_handler_runs(kind: str, metadata, words) -> None:
    echo = Echo()

    async def scenario():
        async with (
            echo_server(TenantAuthInterceptor(registry()), echo) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, kind, metadata, refused=True)
        return caught.value

    error = run(scenario)
    assert_status(error, grpc.StatusCode.UNAUTHENTICATED, *words)
    assert "sd_" not in error.details()  # the key is never echoed
    assert echo.calls == 0


def test_health_and_reflection_need_no_key() -> None:
    async def scenario():
        async with (
            echo_server(TenantAuthInterceptor(registry()), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            listing = [response async for response in stream]
        return health, listing

    health, listing = run(scenario)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE in {service.name for service in listing[0].list_services_response.service}


def test_an_open_registry_serves_everyone_as_default() -> None:
    async def scenario():
        async with (
            echo_server(TenantAuthInterceptor(TenantRegistry.open()), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            return await call(channel, "Unary"), await call(channel, "BidiStream", bearer("anything"))

    assert run(scenario) == (_expected("Unary", "default"), _expected("BidiStream", "default"))


def test_current_tenant_outside_a_call_is_a_lookup_error() -> None:
    with pytest.raises(LookupError):
        current_tenant()


@pytest.mark.parametrize("kind", KINDS)
def test_the_cluster_secret_channel_passes_on_every_call_kind(kind: str) -> None:
    async def scenario():
        async with (
            echo_server(ClusterSecretInterceptor(SECRET), Echo()) as target,
            cluster_channel(target, SECRET) as channel,
        ):
            return await call(channel, kind)

    assert run(scenario) == _expected(kind, "-")


@pytest.mark.parametrize(
    ("secret", "words"),
    [(None, ["missing cluster secret", "x-stagediff-cluster-secret"]), (SECRET + "x", ["wrong cluster secret"])],
)
@pytest.mark.parametrize("kind", ["Unary", "ServerStream", "BidiStream"])
@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_a_stage_refuses_calls_without_the_right_secret(secret: str | None, words, kind: str, traced: bool) -> None:
    """Also behind the tracing interceptor, which comes first on every server and wraps the refusal."""
    echo = Echo()
    interceptors = [ClusterSecretInterceptor(SECRET)]
    if traced:
        interceptors.insert(0, tracing_server_interceptor())

    async def scenario():
        async with (
            echo_server(interceptors, echo) as target,
            cluster_channel(target, secret) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, kind, refused=True)
        return caught.value

    error = run(scenario)
    assert_status(error, grpc.StatusCode.UNAUTHENTICATED, *words)
    assert SECRET not in error.details()
    assert echo.calls == 0


def test_health_probes_need_no_secret_but_reflection_does() -> None:
    async def scenario():
        async with (
            echo_server(ClusterSecretInterceptor(SECRET), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            ended = asyncio.Event()

            async def requests():  # sends nothing before the refusal (see call)
                await ended.wait()
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(), timeout=10)
                [response async for response in stream]
            ended.set()
        return health, caught.value

    health, error = run(scenario)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_secret_travels_with_the_caller_metadata() -> None:
    """A channel with the secret keeps the metadata each call sets (here a tenant key)."""

    async def scenario():
        interceptors = [ClusterSecretInterceptor(SECRET), TenantAuthInterceptor(registry())]
        async with echo_server(interceptors, Echo()) as target, cluster_channel(target, SECRET) as channel:
            return await call(channel, "BidiStream", bearer(KEY_BETA))

    assert run(scenario) == _expected("BidiStream", "beta")


def test_the_secret_comes_from_the_file_then_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_cluster_secret(path, environ={CLUSTER_SECRET_ENV: "from-env"}) == SECRET
    assert load_cluster_secret(None, environ={CLUSTER_SECRET_ENV: " from-env\n"}) == "from-env"
    assert load_cluster_secret(None, environ={}) is None
    assert load_cluster_secret(None, environ={CLUSTER_SECRET_ENV: ""}) is None


@pytest.mark.parametrize(
    ("content", "words"),
    [(None, ["cannot read"]), ("\n", ["is empty"]), ("two words", ["printable ASCII without spaces"])],
)
def test_unusable_secret_files_are_refused(tmp_path: Path, content: str | None, words) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ClusterSecretError) as caught:
        load_cluster_secret(path, environ={})
    assert "--cluster-secret-file" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_stage_main_requires_the_secret_unless_insecure(monkeypatch, caplog, tmp_path: Path) -> None:
    from services.stage_main import _secret_interceptors

    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    with pytest.raises(SystemExit) as refused:
        _secret_interceptors("vae", None, insecure=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("stagediff serve vae: no cluster secret")
    for flag in ("--cluster-secret-file", f"${CLUSTER_SECRET_ENV}", "--insecure"):
        assert flag in message
    with caplog.at_level(logging.WARNING, logger="services.stage_main"):
        assert _secret_interceptors("vae", None, insecure=True) == []
    assert "--insecure and no cluster secret" in caplog.text
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    (interceptor,) = _secret_interceptors("vae", None, insecure=False)
    assert isinstance(interceptor, ClusterSecretInterceptor)
    with pytest.raises(SystemExit, match="stagediff serve vae: --cluster-secret-file"):
        _secret_interceptors("vae", str(tmp_path / "missing"), insecure=True)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tls-cert", "c.pem"], ["--tls-cert and --tls-key go together"]),
        (["--tls-client-ca", "ca.pem"], ["--tls-client-ca needs --tls-cert and --tls-key"]),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.key"], ["--tls-cert missing.pem", "cannot read"]),
    ],
)
def test_tls_flags_are_checked(flags: list[str], words: list[str], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    with pytest.raises(TLSConfigError) as caught:
        server_credentials_for(TlsConfig.from_options(parser.parse_args(flags)))
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ([], None),
        (["--stage-tls-cert", "c.pem", "--stage-tls-key", "c.key"], ["need --stage-tls-ca"]),
        (["--stage-tls-ca", "ca.pem", "--stage-tls-key", "c.key"], ["--stage-tls-cert and --stage-tls-key go"]),
        (["--stage-tls-ca", "missing.pem"], ["--stage-tls-ca missing.pem", "cannot read"]),
    ],
)
def test_stage_tls_flags_are_checked(flags: list[str], words: list[str] | None, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_stage_tls_arguments(parser)
    args = parser.parse_args(flags)
    if words is None:
        assert stage_channel_credentials(args.stage_tls_ca, args.stage_tls_cert, args.stage_tls_key) is None, (
            "no flags: plaintext"
        )
        return
    with pytest.raises(TLSConfigError) as caught:
        stage_channel_credentials(args.stage_tls_ca, args.stage_tls_cert, args.stage_tls_key)
    for word in words:
        assert word in str(caught.value)
