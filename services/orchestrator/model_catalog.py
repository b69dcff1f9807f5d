"""The served models, kept in the job store: what lets a model's DiT pool be at zero.

The orchestrator learns its models from the DiT replicas (routes.py). A pool that scales to zero takes that
knowledge with it, and an orchestrator started (or a replica joined) while it is at zero would answer that the
model does not exist instead of queueing its requests until a DiT starts. So every model a serving DiT reports is
written to the job store (store/models.py) when its StageInfo changes, and again every REFRESH_S while it is
served (its `seen_at`, after which a model no DiT reports any more is forgotten); `load` serves them at startup.
The orchestrator keeps them only with --cold-start-timeout: without it every pool serves before the orchestrator
does, and its DiT replicas say which models there are.

Writes run on the store's threads, behind the probes (never on the event loop); a failed write is logged and
tried again with the next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.orchestrator.routes import ModelRoute, ModelRoutes
from services.orchestrator.store import JobStore
from services.orchestrator.store_errors import StoreError
from stagediff.v1 import stages_pb2

logger = logging.getLogger(__name__)

REFRESH_S = 3600.0


class ModelCatalog:
    """Keeps the models of `routes` in `store`: `load` once at startup, then `saw` after each round of probes."""

    def __init__(self, store: JobStore, routes: ModelRoutes, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.routes = routes
        self.clock = clock
        self._saved: dict[str, tuple[stages_pb2.StageInfo, float]] = {}  # model -> (info, when) as last written
        self._writes: set[asyncio.Task] = set()

    async def load(self) -> None:
        """Serves every model the store knows (seen within its FORGET_AFTER_S)."""
        for known in await asyncio.to_thread(self.store.models.load, self.clock()):
            info = stages_pb2.StageInfo.FromString(known.info)
            if self.routes.remember(info, "the job store") is not None:
                self._saved[known.model] = (info, known.seen_at)

    def saw(self, reported: list[ModelRoute]) -> None:
        """Writes the models serving DiT replicas reported whose StageInfo changed, or was last written REFRESH_S
        ago (the probes call it; the writes run in the background)."""
        now = self.clock()
        for route in reported:
            saved = self._saved.get(route.model)
            if saved is not None and saved[0] == route.info and now - saved[1] < REFRESH_S:
                continue
            self._saved[route.model] = (route.info, now)
            task = asyncio.get_running_loop().create_task(self._write(route, now), name=f"save-model-{route.model}")
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write(self, route: ModelRoute, now: float) -> None:
        try:
            await asyncio.to_thread(self.store.models.save, route.model, route.info.SerializeToString(), now)
        except StoreError as error:
            logger.warning("model %s: not kept in the job store (%s); tried again with the next probes", route.model,
                           error)  # fmt: skip
            self._saved.pop(route.model, None)

    async def close(self) -> None:
        """Waits for the writes under way."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
