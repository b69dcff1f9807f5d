"""The options `stagediff serve` runs with, and what each service refuses to start for under the secure
defaults."""

from __future__ import annotations

import argparse
import os
from unittest import mock

import grpc

from services.auth import CLUSTER_SECRET_ENV
from services.orchestrator.service import check_exposure
from services.orchestrator.tenants import TenantRegistry, hash_api_key
from services.server_config import ServerConfig
from tests.helpers.serving import parse_serve

STAGES = ("text-encoder", "dit", "vae", "interp")


def serve_defaults(target: str, *flags: str) -> argparse.Namespace:
    """The options `stagediff serve <target>` runs with, given `flags` and placeholders for the required ones."""
    if target == "orchestrator":
        required = [argument for stage in STAGES for argument in (f"--{stage}", "127.0.0.1:1")]
    elif target == "http":
        required = []  # the gateway's options all have defaults
    else:
        required = ["--model", "m"]
    return parse_serve([target, *required, *flags])


def startup_refusal(target: str, args: argparse.Namespace, has_secret: bool) -> str | None:
    """What `stagediff serve <target>` with `args` would refuse to start for (secret, tenants without TLS), or
    None; `has_secret` says whether a cluster secret reaches it (a file or the environment)."""
    from services.stage_main import _secret_interceptors

    secret_env = {CLUSTER_SECRET_ENV: "a-cluster-secret"} if has_secret else {}
    environment = {key: value for key, value in os.environ.items() if key != CLUSTER_SECRET_ENV} | secret_env
    try:
        if target != "orchestrator":
            with mock.patch.dict(os.environ, environment, clear=True):
                _secret_interceptors(target, None, insecure=args.insecure)
        else:
            tenants = tenant_registry() if args.tenants else TenantRegistry.open()
            credentials = grpc.local_server_credentials() if args.tls_cert else None
            check_exposure(
                ServerConfig.from_options(args), tenants, "a-cluster-secret" if has_secret else None, credentials
            )
    except SystemExit as refused:
        return str(refused)
    return None


def tenant_registry() -> TenantRegistry:
    return TenantRegistry.from_dict({"tenants": [{"name": "acme", "api_keys": [hash_api_key("sd_" + "k" * 43)]}]})
