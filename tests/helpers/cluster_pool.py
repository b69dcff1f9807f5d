"""Local clusters shared by the end-to-end tests: one per (checkpoint, options), started on first use.

A cluster start loads every stage, which costs more than most end-to-end tests themselves, so modules that
need the same checkpoint with the same flags share one cluster through the session's `cluster_pool` fixture
(tests/e2e/conftest.py). Rules for a test that takes a pooled cluster:
- it leaves the cluster as it found it: no killed stage, no changed file, no job left running;
- a test that breaks a cluster on purpose (kills a stage or a rank, fills a disk) starts its own, or takes
  one with `pool.take(...)`, which removes it from the pool, and stops it itself.
At most `keep` pooled clusters run at once: asking for another stops the least recently used one first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

from stagediff.local.supervisor import LocalCluster
from tests.helpers.serving import THREADS_PER_STAGE

STARTUP_TIMEOUT_S = 300.0


def _key(model: Path, extra_args: Mapping[str, Sequence[str]], env: Mapping[str, str]) -> tuple:
    return (
        str(Path(model).resolve()),
        tuple(sorted((service, tuple(flags)) for service, flags in extra_args.items())),
        tuple(sorted(env.items())),
    )


class ClusterPool:
    """Clusters keyed by (checkpoint, extra_args, env); see the module docstring for the rules."""

    def __init__(self, log_root: Path, keep: int = 2) -> None:
        self._log_root = log_root
        self._keep = keep
        self._running: OrderedDict[tuple, LocalCluster] = OrderedDict()
        self._names = itertools.count()
        self.starts = 0

    def get(
        self,
        model: Path,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> LocalCluster:
        """The running cluster of `model` with these options, started if none is."""
        key = _key(model, extra_args or {}, env or {})
        if key in self._running:
            self._running.move_to_end(key)
            return self._running[key]
        while len(self._running) >= self._keep:
            _, oldest = self._running.popitem(last=False)
            oldest.stop()
        cluster = self._start(model, extra_args or {}, env or {})
        self._running[key] = cluster
        return cluster

    def take(
        self,
        model: Path,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> LocalCluster:
        """The cluster of `get`, removed from the pool: the caller may break it and must stop it."""
        cluster = self.get(model, extra_args, env)
        del self._running[_key(model, extra_args or {}, env or {})]
        return cluster

    def stop_all(self) -> None:
        while self._running:
            _, cluster = self._running.popitem()
            cluster.stop()

    def _start(self, model: Path, extra_args: Mapping[str, Sequence[str]], env: Mapping[str, str]) -> LocalCluster:
        cluster = LocalCluster(
            model,
            threads_per_stage=THREADS_PER_STAGE,
            log_dir=self._log_root / f"cluster-{next(self._names)}",
            extra_args={service: list(flags) for service, flags in extra_args.items()},
            env=dict(env) or None,
        )
        cluster.start(timeout=STARTUP_TIMEOUT_S)
        self.starts += 1
        return cluster
