"""The end-to-end tier's tenants cluster: one tenants file holds the tenants of every module that tests tenants
(tests/e2e/test_e2e_tenants.py and tests/e2e/test_fuzz.py), so that they share one pooled cluster.

Each module calls with its own tenants' keys only: their priorities, quotas and rates are what its claims are
about (the fuzz's rate-limited tenant is its own), and no module looks for another module's tenant or jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff.local.supervisor import LocalCluster
from tests.helpers.cluster_pool import ClusterPool

# test_e2e_tenants.py's: alpha (high priority, no quotas, the operator's tenant), beta (normal, no quotas),
# gamma (low priority, one job running and two queued at most, small requests only) and delta (a rate limit
# with a burst of two).
GAMMA_QUOTAS: dict[str, int] = dict(
    max_running_jobs=1, max_queued_jobs=2, max_height=64, max_width=96, max_pixels=64 * 64, max_frames=9, max_steps=4
)
SERVICE_TENANTS: dict[str, dict[str, Any]] = {
    "alpha": dict(priority="high", weight=2, admin=True),
    "beta": dict(priority="normal"),
    "gamma": dict(priority="low", quotas=GAMMA_QUOTAS),
    "delta": dict(priority="normal", quotas=dict(requests_per_minute=30, burst=2)),
}

# test_fuzz.py's. epsilon: an admin, a rate it does not reach, one job running and two queued, requests up to
# 64x64, 9 frames and 2 steps, and 33 frames out (9 frames interpolated 4x, not 8x). zeta: not an admin,
# 6 requests a minute with a burst of 3 (most of its requests find the rate spent), one job running and one
# queued, requests up to 32x32, 5 frames, 1 step, 9 frames out.
FUZZ_TENANT_QUOTAS: dict[str, dict[str, int]] = {
    "epsilon": dict(
        max_running_jobs=1,
        max_queued_jobs=2,
        requests_per_minute=600,
        burst=100,
        max_height=64,
        max_width=64,
        max_pixels=64 * 64,
        max_frames=9,
        max_steps=2,
        max_output_frames=33,
        max_output_pixels=33 * 64 * 64,
        max_watch_streams=4,
    ),
    "zeta": dict(
        max_running_jobs=1,
        max_queued_jobs=1,
        requests_per_minute=6,
        burst=3,
        max_height=32,
        max_width=32,
        max_frames=5,
        max_steps=1,
        max_output_frames=9,
        max_watch_streams=2,
    ),
}
FUZZ_TENANT_ADMINS = frozenset({"epsilon"})


@dataclass(frozen=True)
class TenantsFile:
    path: Path
    keys: dict[str, str]  # tenant -> its API key


def write_tenants_file(directory: Path) -> TenantsFile:
    """A tenants file of SERVICE_TENANTS and FUZZ_TENANT_QUOTAS in `directory`, each tenant with a new key."""
    bodies: dict[str, dict[str, Any]] = {
        **SERVICE_TENANTS,
        **{name: dict(admin=name in FUZZ_TENANT_ADMINS, quotas=quotas) for name, quotas in FUZZ_TENANT_QUOTAS.items()},
    }
    keys = {name: new_api_key() for name in bodies}
    tenants = [{"name": name, "api_keys": [hash_api_key(keys[name])], **body} for name, body in bodies.items()]
    path = directory / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return TenantsFile(path, keys)


def tenants_cluster(pool: ClusterPool, model: Path, tenants: TenantsFile) -> LocalCluster:
    """The pooled cluster of `model` started with the tenants file; the DiT logs JSON, from which
    test_e2e_tenants.py reads when its compute stopped after a cancel."""
    return pool.get(model, {"orchestrator": ["--tenants", str(tenants.path)], "dit": ["--log-format", "json"]})
