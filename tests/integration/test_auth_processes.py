"""Tenant keys on the public port, the cluster secret between services, and TLS, over real aio servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretInterceptor,
    TLSConfigError,
    add_stage_tls_arguments,
    add_tls_arguments,
    channel_credentials,
    cluster_channel,
    server_credentials,
    server_credentials_for,
    stage_channel_credentials,
)
from services.orchestrator.stage_clients import STAGE_ORDER, StagePool
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.server import serve
from services.server_config import TlsConfig
from stagediff.local.supervisor import is_serving, wait_for_serving
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from tests.helpers.auth_servers import KEY_ACME, SECRET, SERVICE, Echo, bearer, call, echo_server, registry, run
from tests.helpers.grpc_channels import assert_status

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
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"a stage process imports {result.stdout.strip()}"


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


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and localhost, one for the name `dit-pods` alone, and a client
    certificate, all signed by the CA; and another CA (other-ca.pem) that signed none of them."""
    folder = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=test-{ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("named", "subjectAltName=DNS:dit-pods\nextendedKeyUsage=serverAuth\n"),
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
                interceptors=[TenantAuthInterceptor(registry())],
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
                results["tls"] = await call(channel, "Unary", bearer(KEY_ACME))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(channel, "Unary")
                results["tls without key"] = caught.value
            async with grpc.aio.insecure_channel(target) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(plain, "Unary", bearer(KEY_ACME))
                results["plaintext"] = caught.value
        finally:
            if not serving.done():
                os.kill(os.getpid(), signal.SIGTERM)  # serve() turns SIGTERM into a graceful stop
            await asyncio.wait_for(serving, timeout=30)
        return results

    results = run(scenario)
    assert results["tls"] == [b"acme"]
    assert_status(results["tls without key"], grpc.StatusCode.UNAUTHENTICATED, "missing API key")
    assert results["plaintext"].code() == grpc.StatusCode.UNAVAILABLE
    assert echo.calls == 1


def test_a_client_ca_requires_client_certificates(certs: Path) -> None:
    credentials = server_credentials(certs / "server.pem", certs / "server.key", certs / "ca.pem")

    async def scenario():
        async with echo_server(None, Echo(), credentials) as target:
            with_cert = channel_credentials(certs / "ca.pem", certs / "client.pem", certs / "client.key")
            async with grpc.aio.secure_channel(target, with_cert) as channel:
                answer = await call(channel, "Unary")
            async with grpc.aio.secure_channel(target, channel_credentials(certs / "ca.pem")) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(channel, "Unary")
        return answer, caught.value

    answer, error = run(scenario)
    assert answer == [b"-"]
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_certificate_from_another_ca_is_not_trusted(certs: Path) -> None:
    async def scenario():
        # Trusting the client certificate instead of the CA: the handshake must fail.
        async with (
            echo_server(None, Echo(), server_credentials(certs / "server.pem", certs / "server.key")) as target,
            grpc.aio.secure_channel(target, channel_credentials(certs / "client.pem")) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "Unary")
        return caught.value

    assert run(scenario).code() == grpc.StatusCode.UNAVAILABLE


def test_no_tls_flags_mean_plaintext_and_complete_flags_build_credentials(certs: Path) -> None:
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    assert server_credentials_for(TlsConfig.from_options(parser.parse_args([]))) is None
    args = parser.parse_args(["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")])
    assert isinstance(server_credentials_for(TlsConfig.from_options(args)), grpc.ServerCredentials)
    with pytest.raises(TLSConfigError, match="both"):
        channel_credentials(certs / "ca.pem", cert_file=certs / "client.pem")


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

    results = run(scenario)
    assert results["right ca"] == [("SERVING", "")] * len(STAGE_ORDER)
    for case in ("plaintext", "other ca"):
        for health, detail in results[case]:
            assert health == "NOT_SERVING" and detail.startswith("unreachable: UNAVAILABLE"), (case, detail)


def test_a_looked_up_address_is_verified_as_the_name_it_was_found_under(certs: Path) -> None:
    """`dns:dit-pods:PORT` finds 127.0.0.1, whose stage's certificate names only `dit-pods`: the pool dials the
    address and checks the certificate against the name; the same address listed as such is refused."""

    async def scenario():
        async with _tls_stage(server_credentials(certs / "named.pem", certs / "named.key")) as target:
            port = target.rsplit(":", 1)[1]
            results = {}
            for case, flag in (("looked up", f"dns:dit-pods:{port}"), ("listed", target)):
                pool = StagePool(
                    {"interp": flag},
                    secret=SECRET,
                    credentials=channel_credentials(certs / "ca.pem"),
                    lookup=lambda name, port: ["127.0.0.1"] if name == "dit-pods" else [],
                )
                try:
                    await pool.discover()
                    await asyncio.wait_for(pool.probe_all(), timeout=30)
                    results[case] = [(replica.endpoint, replica.health) for _, replica in pool.replicas()]
                finally:
                    await pool.close()
            return results

    results = run(scenario)
    assert results["looked up"] == [(f"127.0.0.1:{results['listed'][0][0].rsplit(':', 1)[1]}", "SERVING")]
    assert results["listed"][0][1] == "NOT_SERVING"


def test_mutual_tls_stages_answer_only_the_orchestrators_certificate(certs: Path) -> None:
    parser = argparse.ArgumentParser()
    add_stage_tls_arguments(parser)
    with_flags = parser.parse_args(
        ["--stage-tls-ca", str(certs / "ca.pem"), "--stage-tls-cert", str(certs / "client.pem"),
         "--stage-tls-key", str(certs / "client.key")]
    )  # fmt: skip
    without_flags = parser.parse_args(["--stage-tls-ca", str(certs / "ca.pem")])
    with_cert, without_cert = (
        stage_channel_credentials(args.stage_tls_ca, args.stage_tls_cert, args.stage_tls_key)
        for args in (with_flags, without_flags)
    )

    async def scenario():
        credentials = server_credentials(certs / "server.pem", certs / "server.key", certs / "ca.pem")
        async with _tls_stage(credentials) as target:
            return (
                await _probe_once(target, with_cert),
                await _probe_once(target, without_cert),
            )

    admitted, refused = run(scenario)
    assert admitted == [("SERVING", "")] * len(STAGE_ORDER)
    assert all(health == "NOT_SERVING" and "UNAVAILABLE" in detail for health, detail in refused)


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
        pooled = run(lambda: _probe_once(target, channel_credentials(certs / "ca.pem")))
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
