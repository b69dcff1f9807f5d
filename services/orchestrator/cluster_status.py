"""GetClusterInfo's answer: every stage's health, replicas and StageInfo, for operators (admin tenants).

It reads the pool's periodic probes (every --health-interval), never a probe per call. The stages listed are
those the orchestrator has endpoints for, and any its served chain needs but lacks (NOT_SERVING, with the flag
that gives it one).
"""

from __future__ import annotations

from services.orchestrator.chain import missing_stages
from services.orchestrator.stage_clients import NOT_SERVING, STAGE_ORDER, StagePool
from stagediff import __version__
from stagediff.v1 import generation_pb2, stages_pb2


def cluster_status(pool: StagePool) -> generation_pb2.ClusterInfo:
    """The ClusterInfo of `pool`; the chains of the models its DiT replicas serve name the stages needed."""
    routes = pool.routes.models().values()
    missing = {
        stage for info in [None, *(route.info for route in routes)] for stage in missing_stages(pool.stages, info)
    }
    stages = []
    for name in STAGE_ORDER:
        stage = pool.stages.get(name)
        if stage is None:
            if name in missing:
                stages.append(
                    generation_pb2.StageStatus(
                        info=stages_pb2.StageInfo(stage=name),
                        health=NOT_SERVING,
                        detail=f"no endpoint: the served chain needs it; give the orchestrator --{name} HOST:PORT",
                    )
                )
            continue
        replicas = [
            generation_pb2.ReplicaStatus(
                endpoint=replica.endpoint,
                health=replica.health,
                detail=replica.detail,
                in_flight=replica.in_flight,
                calls=replica.calls,
                info=replica.info,
            )
            for replica in stage.replicas
        ]
        stages.append(
            generation_pb2.StageStatus(
                info=stage.info or stages_pb2.StageInfo(stage=name),
                endpoint=stage.endpoint,
                health=stage.health,
                detail=stage.detail,
                replicas=replicas,
            )
        )
    return generation_pb2.ClusterInfo(stages=stages, version=__version__)
