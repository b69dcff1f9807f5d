"""Why a request is refused at admission, as the gRPC status its call ends with.

`refusal_for` maps each error that admission may raise (REFUSABLE) to its status code, message, retry
delay (a RetryInfo tells the client when to come back: rate, queue) and whether the request's uploaded
images are dropped with it. An upload serves one request: a refusal that a retry of the same request would
meet again drops them; a refusal for load (rate, queue, a starting cluster, the store) leaves them for the
retry. Any other error is a bug, not a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from services.orchestrator.chain import StageNotDeployed
from services.orchestrator.lora_access import LoraNotAllowed, LoraNotFound
from services.orchestrator.scheduler import AdmissionRefused
from services.orchestrator.store_errors import StoreError, StoreUnavailable
from services.orchestrator.tenants import LimitExceeded, ModelNotAllowed, RateLimited
from stagediff.status_details import abort_with_retry
from stagekit.errors import RequestError


class ModelNotFound(LookupError):
    """The request names a model no stage serves (NOT_FOUND)."""


class ClusterNotReady(Exception):
    """Some stage has not reported SERVING since the orchestrator started."""


# What admission raises for a request it will not take; anything else propagates.
STORE_RETRY_S = 1.0  # when to retry an admission the job database could not take

REFUSABLE: tuple[type[Exception], ...] = (
    RateLimited,
    AdmissionRefused,
    LimitExceeded,
    ModelNotAllowed,
    LoraNotFound,
    LoraNotAllowed,
    RequestError,
    ModelNotFound,
    StageNotDeployed,
    ClusterNotReady,
    StoreError,
)


@dataclass(frozen=True)
class Refusal:
    """How a refused request's call ends."""

    code: grpc.StatusCode
    message: str
    # Seconds after which a retry may be taken (a RetryInfo in the status), or None.
    retry_after_s: float | None = None
    # Whether a retry of the same request would be refused again, so that its uploads are dropped now.
    drops_uploads: bool = True


def refusal_for(error: Exception) -> Refusal:
    """The refusal for `error`, one of REFUSABLE."""
    if isinstance(error, RateLimited):
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, error.message, error.retry_after, drops_uploads=False)
    if isinstance(error, AdmissionRefused):
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), error.retry_after_s, drops_uploads=False)
    if isinstance(error, LimitExceeded | ModelNotAllowed | LoraNotFound | LoraNotAllowed):
        return Refusal(error.code, error.message)
    if isinstance(error, RequestError):
        return Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    if isinstance(error, ModelNotFound):
        return Refusal(grpc.StatusCode.NOT_FOUND, str(error))
    if isinstance(error, StageNotDeployed):
        return Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(error))
    if isinstance(error, ClusterNotReady):
        return Refusal(grpc.StatusCode.UNAVAILABLE, str(error), drops_uploads=False)
    if isinstance(error, StoreUnavailable):
        return Refusal(grpc.StatusCode.UNAVAILABLE, f"{error}; retry", STORE_RETRY_S, drops_uploads=False)
    if isinstance(error, StoreError):
        return Refusal(grpc.StatusCode.INTERNAL, f"could not store the job: {error}", drops_uploads=False)
    raise TypeError(f"not a refusal: {type(error).__name__}") from error


async def abort_store_unavailable(context: grpc.aio.ServicerContext[Any, Any], error: StoreUnavailable) -> NoReturn:
    """Ends a call the store could not answer (an outage, a failover) UNAVAILABLE, with a retry delay."""
    await abort_with_retry(context, f"{error}; retry", STORE_RETRY_S, code=grpc.StatusCode.UNAVAILABLE)
