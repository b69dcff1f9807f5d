"""Errors a tenant reads name no internal endpoint; admins and the logs keep the whole message.

A fake DiT fails its call with an address in its detail; the orchestrator's own servicer, pipeline, jobs and
stage pool run against fake stages on 127.0.0.1 (tests/helpers/fake_stages.py), with a tenants file of
one ordinary tenant and one admin. `Cluster` is shared with tests/unit/test_adapter_admission.py.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from services.orchestrator.error_redaction import INTERNAL, for_tenant, redact
from services.orchestrator.stage_clients import StageError
from services.orchestrator.tenants import Tenant
from tests.helpers.fake_cluster import Cluster

# An address the DiT's error names besides its own endpoint (grpc's words for a peer it could not reach).
PEER = "ipv4:10.1.2.3:50052"


def test_a_failed_stage_names_no_endpoint_to_a_tenant_and_its_whole_message_to_an_admin(tmp_path, caplog) -> None:
    failure = f"lora 'big': does not fit (peer {PEER}); raise --lora-cache-bytes"

    async def scenario() -> tuple[list[str], list[str], str]:
        async with Cluster(tmp_path) as cluster:
            cluster.denoiser.failure = failure
            refused = await cluster.generate("acme")
            assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            tenant_sees = [refused.details(), *await cluster.job_errors("acme")]
            admin = await cluster.generate("ops")
            return tenant_sees, [admin.details(), *await cluster.job_errors("ops")], cluster.endpoints["dit"]

    with caplog.at_level(logging.WARNING, logger="services.orchestrator.pipeline"):
        tenant_sees, admin_sees, dit = asyncio.run(scenario())
    assert len(tenant_sees) == 4  # Generate, ListJobs, GetJob, WatchJob
    for message in tenant_sees:
        assert "stage 'dit' failed with INVALID_ARGUMENT: lora 'big': does not fit" in message, message
        assert dit not in message and "10.1.2.3" not in message and "127.0.0.1" not in message, message
    for message in admin_sees:
        assert f"stage 'dit' at {dit} failed" in message and PEER in message, message
    logged = [record.getMessage() for record in caplog.records if "failed" in record.getMessage()]
    assert any(dit in line and PEER in line for line in logged), logged


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            str(StageError("dit", "10.0.0.5:50052,dit-1.dit.svc:50052", grpc.StatusCode.UNAVAILABLE, "gone")),
            "stage 'dit' is unavailable: gone",
        ),
        (
            str(
                StageError(
                    "vae",
                    "vae:7000",
                    grpc.StatusCode.UNAVAILABLE,
                    "no replica came back within 5 s (vae:7000: unreachable: UNAVAILABLE: failed to connect to all "
                    "addresses; last error: UNKNOWN: ipv4:172.18.0.3:7000: Connection refused)",
                )
            ),
            f"stage 'vae' is unavailable: no replica came back within 5 s ({INTERNAL}: unreachable: UNAVAILABLE: "
            f"failed to connect to all addresses; last error: UNKNOWN: {INTERNAL}: Connection refused)",
        ),
        (
            "peer ipv6:%5B::1%5D:50051 and [fd00::5]:8000 and unix:/run/dit.sock",
            f"peer {INTERNAL} and {INTERNAL} and {INTERNAL}",
        ),
        ("prompt: 12 characters; at most 10 are allowed", "prompt: 12 characters; at most 10 are allowed"),
    ],
)
def test_redact_replaces_every_endpoint_and_address(message: str, expected: str) -> None:
    assert redact(message, ["10.0.0.5:50052", "dit-1.dit.svc:50052", "vae:7000"]) == expected


def test_admins_read_the_message_whole() -> None:
    message = "stage 'dit' at 10.0.0.5:50052 failed with INTERNAL: boom"
    assert for_tenant(Tenant(name="ops", admin=True), message) == message
    assert for_tenant(Tenant(name="acme"), message) == "stage 'dit' failed with INTERNAL: boom"
