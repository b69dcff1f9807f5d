"""The end-to-end tier's fixtures: the default local cluster (deploy/docker-compose.cpu.yml), the pool of clusters
shared across modules, the tenants file of the pooled tenants cluster, and the pooled cluster of the demo model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shapeworld.demo_model import CHECKPOINT
from stagediff.local.supervisor import LocalCluster
from tests.helpers import tenant_keys
from tests.helpers.cluster_pool import ClusterPool
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.tenants_cluster import TenantsFile, write_tenants_file

DEMO_ADAPTER = Path(__file__).resolve().parents[2] / "shapeworld" / "adapters" / "red_to_blue.safetensors"


@pytest.fixture(scope="session")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The local cluster every end-to-end test shares (tests that kill stages start their own)."""
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


@pytest.fixture(scope="session")
def demo_cluster_options(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The demo cluster's flags and its tenants' keys, written once, so that every module asks the pool for the
    same cluster."""
    lora_dir = tmp_path_factory.mktemp("demo-loras")
    (lora_dir / DEMO_ADAPTER.name).write_bytes(DEMO_ADAPTER.read_bytes())
    allowed = {"acme": ["red_to_blue"], "globex": []}
    tenants, keys = tenant_keys.tenants_file(tmp_path_factory.mktemp("demo-tenants"), allowed)
    return {"dit": ["--lora-dir", str(lora_dir)], "orchestrator": ["--tenants", str(tenants)]}, keys


@pytest.fixture
def demo_cluster(cluster_pool: ClusterPool, demo_cluster_options) -> tuple[LocalCluster, dict[str, str]]:
    """The demo model (shapeworld/checkpoint) with the HTTP gateway, and each tenant's key: its red_to_blue
    adapter is allowed to acme only, globex may use the base model. Pooled: the demo model's modules share it."""
    extra_args, keys = demo_cluster_options
    return cluster_pool.get(CHECKPOINT, extra_args), keys
