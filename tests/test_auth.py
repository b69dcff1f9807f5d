"""Tenant keys on the public port, the cluster secret between services, and TLS, over real aio servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    ClusterSecretInterceptor,
    TLSConfigError,
    add_stage_tls_arguments,
    add_tls_arguments,
    channel_credentials,
    cluster_channel,
    load_cluster_secret,
    server_credentials,
    server_credentials_from_args,
    stage_channel_credentials_from_args,
)
from services.orchestrator.stage_clients import STAGE_ORDER, StagePool
from services.orchestrator.tenant_auth import TenantAuthInterceptor, current_tenant
from services.orchestrator.tenants import TenantRegistry, hash_api_key
from services.server import serve
from services.tracing import server_interceptor as tracing_server_interceptor
from stagediff.local.supervisor import is_serving, wait_for_serving
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from tests.conftest import assert_status

SERVICE = "test.Echo"
KEY_ACME = "sd_acme-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
KEY_BETA = "sd_beta-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
SECRET = "cluster-secret-0123456789abcdefghijklmnop"
KINDS = ("Unary", "ServerStream", "WriteStream", "ClientStream", "BidiStream")


def _registry() -> TenantRegistry:
    return TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "acme", "api_keys": [hash_api_key(KEY_ACME)]},
                {"name": "beta", "api_keys": [hash_api_key(KEY_BETA)]},
            ]
        }
    )


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


class Echo:
    """A service of every call kind that answers with the caller's tenant ('-' when none is set)."""

    def __init__(self) -> None:
        self.calls = 0

    def _who(self) -> bytes:
        self.calls += 1
        try:
            return current_tenant().name.encode()
        except LookupError:
            return b"-"

    def handler(self) -> grpc.GenericRpcHandler:
        async def unary(request, context):
            return self._who()

        async def server_stream(request, context):
            who = self._who()
            yield who
            await asyncio.sleep(0)  # the tenant stays set across the generator's suspensions
            yield current_tenant().name.encode() if who != b"-" else who

        async def write_stream(request, context):
            await context.write(self._who())

        async def client_stream(requests, context):
            count = 0
            async for _ in requests:
                count += 1
            return self._who() + b"/%d" % count

        async def bidi_stream(requests, context):
            async for request in requests:
                yield self._who() + b":" + request

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
                "WriteStream": grpc.unary_stream_rpc_method_handler(write_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
                "BidiStream": grpc.stream_stream_rpc_method_handler(bidi_stream),
            },
        )


async def _call(channel: grpc.aio.Channel, kind: str, metadata=(), refused: bool = False) -> list[bytes]:
    """Calls `kind` on the echo service; returns what came back as a list.

    With `refused`, a request stream sends nothing until the call has ended: a
    grpc aio client that is still writing when the server ends the call may
    report INTERNAL instead of the server's status (grpc/grpc#36066), and a
    refusal depends only on the headers.
    """
    method = f"/{SERVICE}/{kind}"
    if kind == "Unary":
        return [await channel.unary_unary(method)(b"x", metadata=metadata, timeout=10)]
    if kind in ("ServerStream", "WriteStream"):
        return [r async for r in channel.unary_stream(method)(b"x", metadata=metadata, timeout=10)]
    ended = asyncio.Event()

    async def requests():
        if refused:
            await ended.wait()
            return
        yield b"a"
        yield b"b"

    try:
        if kind == "ClientStream":
            return [await channel.stream_unary(method)(requests(), metadata=metadata, timeout=10)]
        return [r async for r in channel.stream_stream(method)(requests(), metadata=metadata, timeout=10)]
    finally:
        ended.set()


EXPECTED = {
    "Unary": [b"{t}"],
    "ServerStream": [b"{t}", b"{t}"],
    "WriteStream": [b"{t}"],
    "ClientStream": [b"{t}/2"],
    "BidiStream": [b"{t}:a", b"{t}:b"],
}


def _expected(kind: str, tenant: str) -> list[bytes]:
    return [item.replace(b"{t}", tenant.encode()) for item in EXPECTED[kind]]


@contextlib.asynccontextmanager
async def _server(
    interceptor: grpc.aio.ServerInterceptor | list[grpc.aio.ServerInterceptor] | None,
    echo: Echo,
    credentials: grpc.ServerCredentials | None = None,
) -> AsyncIterator[str]:
    """A real aio server with the echo service, health and reflection on a free port."""
    interceptors = interceptor if isinstance(interceptor, list) else [interceptor] if interceptor else None
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((echo.handler(),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _run(scenario: Callable[[], Awaitable]):
    return asyncio.run(scenario())


# ------------------------------------------------------- tenant keys --


@pytest.mark.parametrize("kind", KINDS)
def test_the_right_key_reaches_the_handler_as_its_tenant(kind: str) -> None:
    async def scenario():
        echo = Echo()
        async with (
            _server(TenantAuthInterceptor(_registry()), echo) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            return await _call(channel, kind, _bearer(KEY_ACME)), await _call(channel, kind, _bearer(KEY_BETA))

    as_acme, as_beta = _run(scenario)
    assert as_acme == _expected(kind, "acme")
    assert as_beta == _expected(kind, "beta")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ((), ["missing API key", "authorization: Bearer"]),
        (_bearer(KEY_ACME[:-1] + "X"), ["invalid API key"]),
        ((("authorization", KEY_ACME),), ["malformed"]),
    ],
)
def test_no_key_or_a_wrong_key_is_unauthenticated_before_the_handler_runs(kind: str, metadata, words) -> None:
    echo = Echo()

    async def scenario():
        async with (
            _server(TenantAuthInterceptor(_registry()), echo) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _call(channel, kind, metadata, refused=True)
        return caught.value

    error = _run(scenario)
    assert_status(error, grpc.StatusCode.UNAUTHENTICATED, *words)
    assert "sd_" not in error.details()  # the key is never echoed
    assert echo.calls == 0


def test_health_and_reflection_need_no_key() -> None:
    async def scenario():
        async with (
            _server(TenantAuthInterceptor(_registry()), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            listing = [response async for response in stream]
        return health, listing

    health, listing = _run(scenario)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE in {service.name for service in listing[0].list_services_response.service}


def test_an_open_registry_serves_everyone_as_default() -> None:
    async def scenario():
        async with (
            _server(TenantAuthInterceptor(TenantRegistry.open()), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            return await _call(channel, "Unary"), await _call(channel, "BidiStream", _bearer("anything"))

    assert _run(scenario) == (_expected("Unary", "default"), _expected("BidiStream", "default"))


def test_current_tenant_outside_a_call_is_a_lookup_error() -> None:
    with pytest.raises(LookupError):
        current_tenant()


# ----------------------------------------------------- cluster secret --


@pytest.mark.parametrize("kind", KINDS)
def test_the_cluster_secret_channel_passes_on_every_call_kind(kind: str) -> None:
    async def scenario():
        async with (
            _server(ClusterSecretInterceptor(SECRET), Echo()) as target,
            cluster_channel(target, SECRET) as channel,
        ):
            return await _call(channel, kind)

    assert _run(scenario) == _expected(kind, "-")


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
            _server(interceptors, echo) as target,
            cluster_channel(target, secret) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _call(channel, kind, refused=True)
        return caught.value

    error = _run(scenario)
    assert_status(error, grpc.StatusCode.UNAUTHENTICATED, *words)
    assert SECRET not in error.details()
    assert echo.calls == 0


def test_health_probes_need_no_secret_but_reflection_does() -> None:
    async def scenario():
        async with (
            _server(ClusterSecretInterceptor(SECRET), Echo()) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            ended = asyncio.Event()

            async def requests():  # sends nothing before the refusal (see _call)
                await ended.wait()
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(), timeout=10)
                [response async for response in stream]
            ended.set()
        return health, caught.value

    health, error = _run(scenario)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_secret_travels_with_the_caller_metadata() -> None:
    """A channel with the secret keeps the metadata each call sets (here a tenant key)."""

    async def scenario():
        interceptors = [ClusterSecretInterceptor(SECRET), TenantAuthInterceptor(_registry())]
        async with _server(interceptors, Echo()) as target, cluster_channel(target, SECRET) as channel:
            return await _call(channel, "BidiStream", _bearer(KEY_BETA))

    assert _run(scenario) == _expected("BidiStream", "beta")


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


STAGE_BOOTSTRAP = ("services.server", "services.auth", "services.stage_main")
# What only the orchestrator's tenants need.
ORCHESTRATOR_ONLY = ("pydantic", "yaml", "services.orchestrator")


def test_a_stage_process_loads_no_orchestrator_code() -> None:
    script = (
        "import sys\n"
        + "".join(f"import {module}\n" for module in STAGE_BOOTSTRAP)
        + f"prefixes = {ORCHESTRATOR_ONLY!r}\n"
        + "print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in prefixes)))\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"a stage process imports {result.stdout.strip()}"


def test_stage_main_requires_the_secret_unless_insecure(monkeypatch, caplog, tmp_path: Path) -> None:
    from services.stage_main import _secret_interceptors

    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    with pytest.raises(SystemExit) as refused:
        _secret_interceptors("vae", argparse.Namespace(cluster_secret_file=None, insecure=False))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("stagediff serve vae: no cluster secret")
    for flag in ("--cluster-secret-file", f"${CLUSTER_SECRET_ENV}", "--insecure"):
        assert flag in message
    with caplog.at_level(logging.WARNING, logger="services.stage_main"):
        assert _secret_interceptors("vae", argparse.Namespace(cluster_secret_file=None, insecure=True)) == []
    assert "--insecure and no cluster secret" in caplog.text
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    (interceptor,) = _secret_interceptors("vae", argparse.Namespace(cluster_secret_file=None, insecure=False))
    assert isinstance(interceptor, ClusterSecretInterceptor)
    with pytest.raises(SystemExit, match="stagediff serve vae: --cluster-secret-file"):
        _secret_interceptors("vae", argparse.Namespace(cluster_secret_file=str(tmp_path / "missing"), insecure=True))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stage_started_with_a_secret_file_answers_only_its_cluster(tiny_model: Path, tmp_path: Path) -> None:
    secret_file = tmp_path / "cluster-secret"
    secret_file.write_text(SECRET + "\n")
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if key != CLUSTER_SECRET_ENV}
    log = (tmp_path / "log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "serve", "text-encoder", "--model", str(tiny_model),
         "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--cluster-secret-file", str(secret_file)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    target = f"127.0.0.1:{port}"

    async def calls():
        request = stages_pb2.GetStageInfoRequest()
        async with grpc.aio.insecure_channel(target) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stages_pb2_grpc.StageControlStub(plain).GetStageInfo(request, timeout=10)
        async with cluster_channel(target, SECRET) as channel:
            info = await stages_pb2_grpc.StageControlStub(channel).GetStageInfo(request, timeout=10)
        return caught.value, info

    try:
        wait_for_serving(target, timeout=120)  # health answers without the secret
        error, info = asyncio.run(calls())
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    assert_status(error, grpc.StatusCode.UNAUTHENTICATED, "missing cluster secret")
    assert info.stage == "text-encoder"


# -------------------------------------------------------------------- tls --


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA;
    and another CA (other-ca.pem) that signed none of them."""
    folder = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=test-{ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (folder / f"{name}.ext").write_text(extensions)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=folder)  # fmt: skip
    return folder


def test_serve_with_tls_and_tenant_keys(certs: Path) -> None:
    """services.server.serve with TLS credentials and the tenant interceptor, stopped by SIGTERM."""
    port = _free_port()
    target = f"127.0.0.1:{port}"
    echo = Echo()

    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((echo.handler(),))
        return [SERVICE]

    async def scenario():
        serving = asyncio.create_task(
            serve(
                name="tls-test",
                host="127.0.0.1",
                port=port,
                register=register,
                grace=1.0,
                interceptors=[TenantAuthInterceptor(_registry())],
                credentials=server_credentials(certs / "server.pem", certs / "server.key"),
            )
        )
        results = {}
        try:
            async with grpc.aio.secure_channel(target, channel_credentials(certs / "ca.pem")) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while (await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=30)).status != (
                    health_pb2.HealthCheckResponse.SERVING
                ):
                    await asyncio.sleep(0.05)
                results["tls"] = await _call(channel, "Unary", _bearer(KEY_ACME))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await _call(channel, "Unary")
                results["tls without key"] = caught.value
            async with grpc.aio.insecure_channel(target) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await _call(plain, "Unary", _bearer(KEY_ACME))
                results["plaintext"] = caught.value
        finally:
            if not serving.done():
                os.kill(os.getpid(), signal.SIGTERM)  # serve() turns SIGTERM into a graceful stop
            await asyncio.wait_for(serving, timeout=30)
        return results

    results = _run(scenario)
    assert results["tls"] == [b"acme"]
    assert_status(results["tls without key"], grpc.StatusCode.UNAUTHENTICATED, "missing API key")
    assert results["plaintext"].code() == grpc.StatusCode.UNAVAILABLE
    assert echo.calls == 1


def test_a_client_ca_requires_client_certificates(certs: Path) -> None:
    credentials = server_credentials(certs / "server.pem", certs / "server.key", certs / "ca.pem")

    async def scenario():
        async with _server(None, Echo(), credentials) as target:
            with_cert = channel_credentials(certs / "ca.pem", certs / "client.pem", certs / "client.key")
            async with grpc.aio.secure_channel(target, with_cert) as channel:
                answer = await _call(channel, "Unary")
            async with grpc.aio.secure_channel(target, channel_credentials(certs / "ca.pem")) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await _call(channel, "Unary")
        return answer, caught.value

    answer, error = _run(scenario)
    assert answer == [b"-"]
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_certificate_from_another_ca_is_not_trusted(certs: Path) -> None:
    async def scenario():
        # Trusting the client certificate instead of the CA: the handshake must fail.
        async with (
            _server(None, Echo(), server_credentials(certs / "server.pem", certs / "server.key")) as target,
            grpc.aio.secure_channel(target, channel_credentials(certs / "client.pem")) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _call(channel, "Unary")
        return caught.value

    assert _run(scenario).code() == grpc.StatusCode.UNAVAILABLE


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
        server_credentials_from_args(parser.parse_args(flags))
    for word in words:
        assert word in str(caught.value)


def test_no_tls_flags_mean_plaintext_and_complete_flags_build_credentials(certs: Path) -> None:
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    assert server_credentials_from_args(parser.parse_args([])) is None
    args = parser.parse_args(["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")])
    assert isinstance(server_credentials_from_args(args), grpc.ServerCredentials)
    with pytest.raises(TLSConfigError, match="both"):
        channel_credentials(certs / "ca.pem", cert_file=certs / "client.pem")


# ------------------------------------------------------- stage tls --


class _StageInfo(stages_pb2_grpc.StageControlServicer):
    async def GetStageInfo(self, request, context):
        return stages_pb2.StageInfo(stage="interp", model="tls-test")


@contextlib.asynccontextmanager
async def _tls_stage(credentials: grpc.ServerCredentials) -> AsyncIterator[str]:
    """A stage-like server on a free port: StageControl behind the cluster secret, health SERVING, over TLS."""
    server = grpc.aio.server(interceptors=[ClusterSecretInterceptor(SECRET)])
    stages_pb2_grpc.add_StageControlServicer_to_server(_StageInfo(), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _probe_once(target: str, credentials: grpc.ChannelCredentials | None) -> list[tuple[str, str]]:
    """One probe round of an orchestrator's StagePool whose four stages are all `target`: (health, detail) each."""
    pool = StagePool({stage: target for stage in STAGE_ORDER}, secret=SECRET, credentials=credentials)
    try:
        # A failed handshake must end the probe with UNAVAILABLE, not leave it waiting.
        await asyncio.wait_for(pool.probe_all(), timeout=30)
        return [(replica.health, replica.detail) for _, replica in pool.replicas()]
    finally:
        await pool.close()


def test_the_stage_pool_reaches_a_tls_stage_only_trusting_its_ca(certs: Path) -> None:
    async def scenario():
        async with _tls_stage(server_credentials(certs / "server.pem", certs / "server.key")) as target:
            return {
                "right ca": await _probe_once(target, channel_credentials(certs / "ca.pem")),
                "plaintext": await _probe_once(target, None),
                "other ca": await _probe_once(target, channel_credentials(certs / "other-ca.pem")),
            }

    results = _run(scenario)
    assert results["right ca"] == [("SERVING", "")] * len(STAGE_ORDER)
    for case in ("plaintext", "other ca"):
        for health, detail in results[case]:
            assert health == "NOT_SERVING" and detail.startswith("unreachable: UNAVAILABLE"), (case, detail)


def test_mutual_tls_stages_answer_only_the_orchestrators_certificate(certs: Path) -> None:
    parser = argparse.ArgumentParser()
    add_stage_tls_arguments(parser)
    with_cert = parser.parse_args(
        ["--stage-tls-ca", str(certs / "ca.pem"), "--stage-tls-cert", str(certs / "client.pem"),
         "--stage-tls-key", str(certs / "client.key")]
    )  # fmt: skip
    without_cert = parser.parse_args(["--stage-tls-ca", str(certs / "ca.pem")])

    async def scenario():
        credentials = server_credentials(certs / "server.pem", certs / "server.key", certs / "ca.pem")
        async with _tls_stage(credentials) as target:
            return (
                await _probe_once(target, stage_channel_credentials_from_args(with_cert)),
                await _probe_once(target, stage_channel_credentials_from_args(without_cert)),
            )

    admitted, refused = _run(scenario)
    assert admitted == [("SERVING", "")] * len(STAGE_ORDER)
    assert all(health == "NOT_SERVING" and "UNAVAILABLE" in detail for health, detail in refused)


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
    if words is None:
        assert stage_channel_credentials_from_args(parser.parse_args(flags)) is None, "no flags: plaintext"
        return
    with pytest.raises(TLSConfigError) as caught:
        stage_channel_credentials_from_args(parser.parse_args(flags))
    for word in words:
        assert word in str(caught.value)


def test_a_real_stage_serves_tls_to_the_stage_pool_and_stagediff_health(
    tiny_model: Path, certs: Path, tmp_path: Path
) -> None:
    """`stagediff serve interp --tls-cert --tls-key`: the orchestrator's pool and `stagediff health --ca-cert`
    reach it over TLS; a plaintext health check does not."""
    port = _free_port()
    target = f"127.0.0.1:{port}"
    log = (tmp_path / "log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "serve", "interp", "--model", str(tiny_model), "--port", str(port),
         "--threads", "1", "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, CLUSTER_SECRET_ENV: SECRET},
    )  # fmt: skip
    try:
        wait_for_serving(target, timeout=120, credentials=channel_credentials(certs / "ca.pem"))
        pooled = _run(lambda: _probe_once(target, channel_credentials(certs / "ca.pem")))
        cli = subprocess.run(
            [sys.executable, "-m", "stagediff.cli", "health", "--endpoint", f"localhost:{port}",
             "--ca-cert", str(certs / "ca.pem")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        plaintext_serving = is_serving(target, timeout=5)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    assert pooled == [("SERVING", "")] * len(STAGE_ORDER)
    assert cli.returncode == 0 and cli.stdout.strip() == "SERVING", cli.stdout + cli.stderr
    assert not plaintext_serving
    assert f"listening on 127.0.0.1:{port} (TLS)" in (tmp_path / "log").read_text()
