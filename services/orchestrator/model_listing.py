"""What ListModels (and the HTTP /v1/models) says of each model a tenant may use: its family and limits (the
adapters it may use only), and where it stands: the replicas serving it at each stage of its chain, and whether it
serves now, is scaled to zero and starts on demand (--cold-start-timeout), or cannot run until a replica comes.
"""

from __future__ import annotations

from services.orchestrator.lora_access import visible
from services.orchestrator.routes import ModelRoute
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.tenants import Tenant, visible_models
from stagediff.v1 import generation_pb2, stages_pb2

SERVING = "serving"


def list_models(pool: StagePool, tenant: Tenant) -> list[generation_pb2.ModelDescription]:
    """The models `tenant` may use, in the order they were first served."""
    routes = pool.routes.models()
    return [describe(routes[model], pool, tenant) for model in visible_models(tenant, routes)]


def describe(route: ModelRoute, pool: StagePool, tenant: Tenant) -> generation_pb2.ModelDescription:
    info = route.info
    limits = stages_pb2.ModelLimits()
    limits.CopyFrom(info.limits)
    # Each tenant sees the adapters it may use, never another tenant's.
    del limits.loras[:]
    limits.loras.extend(visible(tenant, info.limits.loras))
    serving = {
        stage: len(pool[stage].serving(route.accepts(stage))) for stage in route.family.chain if stage in pool.stages
    }
    return generation_pb2.ModelDescription(
        id=route.model,
        family=info.family,
        limits=limits,
        serving_replicas=serving,
        status=status(route, serving, pool.cold_start_s),
    )


def status(route: ModelRoute, serving: dict[str, int], cold_start_s: float) -> str:
    """ "serving", or why not and what a request meets: a wait for the stages at zero, or a failure."""
    empty = [stage for stage in route.family.required_stages() if not serving.get(stage)]
    if not empty:
        return SERVING
    stages = ", ".join(empty)
    if cold_start_s:
        return f"scaled to zero at {stages}: starts on demand; a request waits up to {cold_start_s:g} s for it"
    return f"unavailable: no replica serves it at {stages}"
