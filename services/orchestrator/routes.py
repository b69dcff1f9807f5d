"""Which replicas serve which model: one orchestrator serves every model whose stages it can reach.

The DiT replicas say which models there are: each reports its model id, family, limits and every component of
its checkpoint with its identity (StageInfo.model_components). A model's route (`ModelRoute`) is its family's
chain, and for each stage the replicas that can serve its calls:

- the DiT: the replicas serving that model id;
- the text encoder and the VAE: the replicas that hold the model's components for the stage, by identity, and
  run the same family code for the call (services/component_identity.py `serves`), so that one text-encoder
  pool whose UMT5 is the same files serves Wan2.1 T2V, Wan2.2 T2V and Wan2.2 I2V alike;
- the interpolator: every replica (it reads no checkpoint).

A replica that reports no components (one of an older build) serves a model that reports none either, as one
model's cluster always did. Which model id a call names is the replica's own unless it serves the route's too
(`model_for`): the stage checks the id against what it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from families.base import Family
from families.registry import FAMILIES
from services.component_identity import serves
from services.orchestrator.refusals import ModelNotFound
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError

logger = logging.getLogger(__name__)

# Models one orchestrator serves at most (each a route, a metric label value and a ListModels entry).
MAX_MODELS = 256
# Which replicas of a stage may take a call: a test of each replica's StageInfo.
Accepts = Callable[[stages_pb2.StageInfo], bool]


def accept_any(info: stages_pb2.StageInfo) -> bool:
    return True


@dataclass(frozen=True)
class ModelRoute:
    """A served model: the StageInfo of a DiT replica of it, its family, and who serves its calls elsewhere."""

    model: str
    info: stages_pb2.StageInfo
    family: Family

    def accepts(self, stage: str, operation: str = "") -> Accepts:
        """Which replicas of `stage` serve this model's `operation` there ("encode" or "decode" on the VAE)."""
        if stage == "dit":
            return lambda info: info.model == self.model
        if stage == "interp":
            return accept_any
        model_components = dict(self.info.model_components)

        def accepted(info: stages_pb2.StageInfo) -> bool:
            if not info.components and not model_components:
                return True  # neither side reports identities: every replica serves, as in one model's cluster
            family = FAMILIES.get(info.family)
            if family is None:
                return False
            return serves(stage, operation, family, dict(info.components), self.family, model_components)

        return accepted

    def model_for(self, info: stages_pb2.StageInfo | None) -> str:
        """The model id a call to that replica names: this model where it serves it under that id (or where its
        info is not known), else its own."""
        if info is None or self.model in info.models or info.model == self.model:
            return self.model
        return info.model


class Reporting(Protocol):
    """A DiT replica as the routes read it (stage_clients.StageClient)."""

    endpoint: str
    info: stages_pb2.StageInfo | None

    @property
    def serving(self) -> bool: ...


class ModelRoutes:
    """The models served here: each one a DiT replica has reported since the orchestrator started, in the order
    they were first seen, kept when its replicas go (its jobs wait for one). A family this build does not know is
    left out (chain.py says why); at most MAX_MODELS models are kept."""

    def __init__(self) -> None:
        self._routes: dict[str, ModelRoute] = {}
        self._reported: set[str] = set()  # the models a DiT replica reported (not only the job store)

    def models(self) -> dict[str, ModelRoute]:
        return dict(self._routes)

    def get(self, model: str) -> ModelRoute | None:
        return self._routes.get(model)

    def default(self, visible: Sequence[str]) -> str:
        """The model a request that names none gets: the only one its tenant may use (`visible`) that a DiT replica
        has reported (one known from the job store alone may be a model no longer deployed), else the only one it
        may use, else none (the request must name it)."""
        reported = [model for model in visible if model in self._reported]
        if len(reported) == 1:
            return reported[0]
        return visible[0] if len(visible) == 1 else ""

    def resolve(self, model: str, visible: Sequence[str]) -> ModelRoute:
        """The route of a request's `model` (the default where empty); RequestError or ModelNotFound naming the
        models the caller may see (`visible`)."""
        model = model or self.default(visible)
        if not model:
            raise RequestError(f"model: this cluster serves several models; name one of {', '.join(visible)}")
        route = self._routes.get(model)
        if route is None:
            raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(visible)}")
        return route

    def learn(self, replicas: Iterable[Reporting]) -> list[ModelRoute]:
        """Takes in what the DiT replicas report of their models (after each round of probes); the latest
        StageInfo of each model wins, a serving replica's over one that is not. Returns the routes of the models
        serving replicas reported."""
        reporting = [replica for replica in replicas if replica.info is not None]
        reported: dict[str, ModelRoute] = {}
        for replica in sorted(reporting, key=lambda replica: replica.serving):  # serving ones last: they win
            info = replica.info
            assert info is not None
            route = self.remember(info, f"the DiT at {replica.endpoint}")
            if route is not None:
                self._reported.add(route.model)
                if replica.serving:
                    reported[route.model] = route
        return list(reported.values())

    def remember(self, info: stages_pb2.StageInfo, source: str) -> ModelRoute | None:
        """Serves the model a DiT's StageInfo describes (from `source`: a replica, or the job store where it was
        kept); None for a family this build does not know, or a model beyond MAX_MODELS."""
        family, known = FAMILIES.get(info.family), self._routes.get(info.model)
        if family is None or (known is None and len(self._routes) >= MAX_MODELS):
            return None
        if known is None:
            logger.info("model %s (%s) is served, as %s says", info.model, info.family, source)
        route = self._routes[info.model] = ModelRoute(info.model, info, family)
        return route
