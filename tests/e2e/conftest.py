"""The end-to-end tier's fixtures: the default local cluster (deploy/docker-compose.cpu.yml), the pool of clusters
shared across modules, and the tenants file of the pooled tenants cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster_pool import ClusterPool
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.tenants_cluster import TenantsFile, write_tenants_file


@pytest.fixture(scope="session")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The local cluster every end-to-end test shares (tests that kill stages start their own)."""
    from stagediff.local.supervisor import LocalCluster

    local = LocalCluster(
        tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path_factory.mktemp("cluster-logs")
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def cluster_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterPool]:
    """Clusters shared across modules, one per (checkpoint, options): tests/helpers/cluster_pool.py."""
    pool = ClusterPool(tmp_path_factory.mktemp("pooled-clusters"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> TenantsFile:
    """The tenants file of the pooled tenants cluster (tests/helpers/tenants_cluster.py)."""
    return write_tenants_file(tmp_path_factory.mktemp("tenants"))
