"""Secure by default: servers and metrics bind loopback, stages need the cluster secret, and an orchestrator
with tenants refuses to send API keys in clear beyond this machine, unless told --insecure."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import grpc
import pytest

from services.auth import CLUSTER_SECRET_ENV
from services.orchestrator.service import check_exposure
from services.orchestrator.tenants import TenantRegistry
from services.server import is_loopback
from services.server_config import ServerConfig
from services.stage_table import SERVE_TARGETS
from tests.helpers.secure_defaults import serve_defaults, tenant_registry


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_every_server_binds_loopback_unless_told_otherwise(target: str) -> None:
    assert serve_defaults(target).host == "127.0.0.1"
    assert serve_defaults(target, "--host", "0.0.0.0").host == "0.0.0.0"


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.7", "orchestrator", "2001:db8::1"):
        assert not is_loopback(host), host


def _options(host: str, insecure: bool = False) -> ServerConfig:
    return dataclasses.replace(ServerConfig.from_options(serve_defaults("orchestrator")), host=host, insecure=insecure)


def test_tenants_on_a_non_loopback_host_need_tls_or_insecure(caplog) -> None:
    tls = grpc.local_server_credentials()  # credentials of any kind stand for --tls-cert/--tls-key here
    for host in ("0.0.0.0", "::", "10.0.0.7"):
        with pytest.raises(SystemExit) as refused:
            check_exposure(_options(host), tenant_registry(), "secret", None)
        message = str(refused.value)
        assert message.startswith(f"stagediff serve orchestrator: --tenants on --host {host} without TLS")
        for flag in ("--tls-cert", "--tls-key", "--insecure"):
            assert flag in message
        check_exposure(_options(host), tenant_registry(), "secret", tls)
        check_exposure(_options(host), TenantRegistry.open(), "secret", None)  # the open tenant has no key to leak
    check_exposure(_options("127.0.0.1"), tenant_registry(), "secret", None)
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.service"):
        check_exposure(_options("0.0.0.0", insecure=True), tenant_registry(), "secret", None)
    assert "--insecure: API keys reach --host 0.0.0.0 in clear" in caplog.text


def test_an_orchestrator_without_a_cluster_secret_needs_insecure(caplog) -> None:
    with pytest.raises(SystemExit) as refused:
        check_exposure(_options("127.0.0.1"), TenantRegistry.open(), None, None)
    for flag in ("--cluster-secret-file", f"${CLUSTER_SECRET_ENV}", "--insecure"):
        assert flag in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="services.orchestrator.service"):
        check_exposure(_options("127.0.0.1", insecure=True), TenantRegistry.open(), None, None)
    assert "only stages started with --insecure will answer" in caplog.text


def test_node_0_of_a_multinode_group_must_bind_where_the_other_nodes_reach_it() -> None:
    """Its control channel binds --host: loopback cannot be reached at another machine's --master-addr."""
    from dit_svc.config import parallel_config
    from dit_svc.config_checks import check_node_layout

    def check(args: argparse.Namespace) -> None:
        check_node_layout(
            parallel_config(ulysses_degree=args.ulysses_degree),
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            group_port=args.group_port,
            host=args.host,
            cluster_secret_file=args.cluster_secret_file,
        )

    layout = ("--ulysses-degree", "2", "--nnodes", "2", "--master-addr", "dit-group-0.dit-group")
    with pytest.raises(ValueError) as refused:
        check(serve_defaults("dit", *layout))
    assert "--host 127.0.0.1" in str(refused.value) and "--master-addr dit-group-0.dit-group" in str(refused.value)
    check(serve_defaults("dit", *layout, "--host", "0.0.0.0"))
    check(serve_defaults("dit", "--ulysses-degree", "2", "--nnodes", "2"))  # master-addr 127.0.0.1


def test_the_http_gateway_refuses_plain_http_beyond_loopback() -> None:
    from services.gateway.config import GatewayConfig
    from services.gateway.service import startup_problem as problem_of_config

    def startup_problem(args: argparse.Namespace) -> str | None:
        return problem_of_config(GatewayConfig.from_options(args))

    assert startup_problem(serve_defaults("http")) is None  # 127.0.0.1
    refused = startup_problem(serve_defaults("http", "--host", "0.0.0.0"))
    assert refused is not None and "--insecure" in refused and "in clear" in refused
    assert startup_problem(serve_defaults("http", "--host", "0.0.0.0", "--insecure")) is None
    assert (
        startup_problem(serve_defaults("http", "--host", "0.0.0.0", "--tls-cert", "c.pem", "--tls-key", "k.pem"))
        is None
    )
    assert "go together" in startup_problem(serve_defaults("http", "--tls-cert", "c.pem"))
