"""What a tenant reads of an error: never where the cluster's stages run.

A failed stage call names its stage and the replica's endpoint (stage_clients.StageError: "stage 'dit' at
10.0.0.5:50052 failed with ..."), so that an operator knows which process to look at, and grpc's own details
name addresses too ("ipv4:10.0.0.5:50052: Connection refused"). The cluster's layout is for admin tenants
only (GetClusterInfo), so the public port shows every other tenant a job's error through `for_tenant`: each
stage endpoint and each network address replaced by INTERNAL, and "stage 'dit' at <endpoint>" shortened to
"stage 'dit'". Admins read the message whole; the logs and the job store keep it whole for everyone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from services.orchestrator.tenants import Tenant
from stagediff.v1 import generation_pb2

# What an endpoint becomes in a message a tenant reads.
INTERNAL = "<internal>"
# Network addresses in grpc's and the stages' words: grpc's "ipv4:"/"ipv6:"/"unix:" targets, IPv4 with or
# without a port, bracketed IPv6 with a port, and a host name with a port.
_ADDRESS = re.compile(
    r"(?:ipv[46]:|dns:(?://[^/\s]*/)?)?(?:"
    r"\[[0-9A-Fa-f:.%]+\](?::\d{1,5})?"  # [::1]:50051
    r"|%5B[0-9A-Fa-f:.%]+%5D(?::\d{1,5})?"  # grpc's ipv6:%5B::1%5D:50051
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # 10.0.0.5:50052, 10.0.0.5
    r"|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*:\d{1,5}\b"  # localhost:50052, dit-0.dit.svc:50052
    r")"
    r"|unix:[^\s,;)]+"
)
# "stage 'dit' at <internal>,<internal>": the words StageError puts before the endpoint.
_STAGE_AT = re.compile(rf"(stage '[^']*') at {re.escape(INTERNAL)}(?:,{re.escape(INTERNAL)})*")


def redact(message: str, endpoints: Iterable[str] = ()) -> str:
    """`message` with every one of `endpoints` (the stages' HOST:PORT) and every network address replaced."""
    for endpoint in sorted(set(endpoints), key=len, reverse=True):
        if endpoint:
            message = message.replace(endpoint, INTERNAL)
    message = _ADDRESS.sub(INTERNAL, message)
    return _STAGE_AT.sub(r"\1", message)


def for_tenant(tenant: Tenant, message: str, endpoints: Iterable[str] = ()) -> str:
    """The message as `tenant` may read it: whole for an admin, redacted for anyone else."""
    return message if tenant.admin else redact(message, endpoints)


def job_for_tenant(tenant: Tenant, job: generation_pb2.Job, endpoints: Iterable[str] = ()) -> generation_pb2.Job:
    """`job` (changed in place) with its error as `tenant` may read it."""
    if job.HasField("error") and job.error.message:
        job.error.message = for_tenant(tenant, job.error.message, endpoints)
    return job
