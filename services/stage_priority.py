"""A stage's compute thread serves the work of higher-priority jobs first.

Every stage runs its torch work on one compute thread (services/stage.py). Its calls queue there: a VAE decodes a
video one latent frame at a time, a text encoder encodes one request at a time, a DiT advances its step engine one
iteration at a time. With first-come order a `high` job's decode waits behind every `low` decode queued before it;
this module orders that queue instead:

- The orchestrator sends each stage call the job's priority class as the `stagediff-priority` metadata
  (`call_metadata`).
- A stage's `CallPriorityInterceptor` gives each call its place: its class, then the order calls arrived in.
- `PriorityExecutor`, the compute thread, runs queued work by that place: the highest class first, then the call
  that arrived first, then the order the call submitted its work. A call's work is submitted piece by piece (a
  latent frame, a step), so a high call's pieces go ahead of a low call's remaining ones at the next piece: a
  running piece is never interrupted.

Work submitted outside a call (loading the model) has class `normal` and place 0; a DiT's step engine, which serves
several calls, queues each iteration at the place of its first member (`running_as`). A call without the metadata, or
with a value that is not a class (an older orchestrator), runs as `normal`: the metadata only orders work and grants
nothing, so it is not refused. Within one class, order stays first come, first served; a class is served strictly before
the classes below it (the orchestrator's admission and the DiT gate already bound how much work of each class reaches a
stage).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import grpc

from services.call_scope import wrap_rpc_handler

PRIORITY_METADATA = "stagediff-priority"
# The classes, first served first (services/orchestrator/scheduler.py's Priority, highest first).
CLASSES = ("high", "normal", "low")
_DEFAULT_RANK = CLASSES.index("normal")

# A call's place in the compute thread's queue: (class rank, the call's arrival number).
_place: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("stage_call_place", default=(_DEFAULT_RANK, 0))


def call_metadata(priority: str) -> tuple[tuple[str, str], ...]:
    """The metadata an orchestrator sends with a job's stage call: its priority class."""
    return ((PRIORITY_METADATA, priority if priority in CLASSES else CLASSES[_DEFAULT_RANK]),)


def class_rank(priority: str | None) -> int:
    """0 for the class served first; a missing or unknown value ranks as `normal`."""
    return CLASSES.index(priority) if priority in CLASSES else _DEFAULT_RANK


def current_place() -> tuple[int, int]:
    """The place of the running call (or of `running_as`) in the compute thread's queue."""
    return _place.get()


def running_as(place: tuple[int, int]) -> contextvars.Token:
    """Sets the place of the work this context submits from now on (a step engine serving several calls)."""
    return _place.set(place)


class CallPriorityInterceptor(grpc.aio.ServerInterceptor):
    """Gives each call its place from its `stagediff-priority` metadata and its arrival, for the call's whole run."""

    def __init__(self) -> None:
        self._arrivals = itertools.count(1)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        metadata = dict(handler_call_details.invocation_metadata or ())
        value = metadata.get(PRIORITY_METADATA)
        place = (class_rank(value if isinstance(value, str) else None), next(self._arrivals))

        def scope(context: grpc.aio.ServicerContext) -> Any:
            # Each call runs in its own task, so the place set here is that call's alone.
            _place.set(place)
            return contextlib.nullcontext()

        return wrap_rpc_handler(handler, scope)


class PriorityExecutor(Executor):
    """One worker thread running submitted work in the order of the submitters' places (see the module's
    docstring), then of submission. A ThreadPoolExecutor of one thread runs it, so that shutting down and the
    interpreter's exit treat the thread as they treat any executor's."""

    def __init__(self, thread_name_prefix: str) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        # (the submitter's place, the submission's number, its future, the work): the first is the smallest.
        self._queue: list[tuple[tuple[int, int], int, Future, Callable[[], Any]]] = []
        self._submitted = itertools.count()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            # One turn of the worker per piece of work: each turn runs the first piece queued at that moment.
            self._worker.submit(self._run_first)
            work: Callable[[], Any] = functools.partial(fn, *args, **kwargs)
            heapq.heappush(self._queue, (current_place(), next(self._submitted), future, work))
        return future

    def has_queued(self) -> bool:
        """Whether work waits for the worker (read from the worker, it is work queued behind the running piece)."""
        with self._lock:
            return bool(self._queue)

    def _run_first(self) -> None:
        with self._lock:
            _, _, future, work = heapq.heappop(self._queue)
        if not future.set_running_or_notify_cancel():
            return  # cancelled while it waited
        try:
            result = work()
        except BaseException as error:  # handed to the submitter, as a ThreadPoolExecutor does
            future.set_exception(error)
        else:
            future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._worker.shutdown(wait=wait, cancel_futures=cancel_futures)
        if cancel_futures:
            with self._lock:
                queued, self._queue = self._queue, []
            for _, _, future, _ in queued:
                future.cancel()
