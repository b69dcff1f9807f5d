"""Fixtures every tier shares: the tiny checkpoints and the diffusers pipelines that load them; the cluster
secret every stage a test starts demands. Shared code is in tests/helpers; the e2e tier's cluster is in
tests/e2e/conftest.py."""

from __future__ import annotations

import os
import shutil
import tempfile

# No test reads or writes the user's own state dir (~/.local/state/stagediff, services/orchestrator/options.py)
# or the registry of the clusters `up` runs ($XDG_RUNTIME_DIR/stagediff, stagediff/cluster_registry.py): set
# before anything imports the defaults, and inherited by every process a test starts.
TEST_STATE_HOME = tempfile.mkdtemp(prefix="stagediff-test-state-")
os.environ["XDG_STATE_HOME"] = TEST_STATE_HOME
os.environ["XDG_RUNTIME_DIR"] = TEST_STATE_HOME

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from families.init_model import init_model  # noqa: E402
from services.auth import CLUSTER_SECRET_ENV  # noqa: E402
from stagediff.local.servers import Postgres, S3Server, postgres, seaweedfs  # noqa: E402
from tests.helpers.grpc_channels import CLUSTER_SECRET  # noqa: E402
from tests.helpers.store import OpenStore, open_embedded  # noqa: E402

# The time each tier took, printed at the end of every run (tests/helpers/tier_times.py).
pytest_plugins = ["tests.helpers.tier_times"]

# Every stage a test starts demands the cluster secret (tests/helpers/grpc_channels.py).
os.environ[CLUSTER_SECRET_ENV] = CLUSTER_SECRET


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_STATE_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def a14b_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan2.2 A14B checkpoint: two experts, `transformer_2` below boundary_ratio."""
    return init_model("wan2.2-a14b", "tiny", tmp_path_factory.mktemp("models") / "a14b-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen-image", "tiny", tmp_path_factory.mktemp("models") / "qwen-tiny", seed=0)


@pytest.fixture(scope="session")
def flux_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1-dev's kind (a guidance embedding), tiny."""
    return init_model("flux", "tiny", tmp_path_factory.mktemp("models") / "flux-tiny", seed=0)


@pytest.fixture(scope="session")
def flux_schnell_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1-schnell's kind (no guidance embedding, a fixed shift), tiny; its text encoders and VAE are
    flux_model's (the same seed and sizes)."""
    return init_model("flux", "tiny-schnell", tmp_path_factory.mktemp("models") / "flux-schnell-tiny", seed=0)


@pytest.fixture(scope="session")
def flux_pipeline(flux_model: Path):
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(flux_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def flux_kontext_model(flux_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1 Kontext, tiny: what `init_model("flux-kontext", "tiny", seed=0)` writes, made from flux_model's
    text encoders, tokenizers, transformer and scheduler (the same builders and seed) and its own 32x VAE,
    without training the tokenizers again."""
    import torch

    from families.flux_kontext.init_model import write_kontext_parts
    from families.registry import FAMILIES

    out = tmp_path_factory.mktemp("models") / "flux-kontext-tiny"
    shutil.copytree(flux_model, out, ignore=shutil.ignore_patterns("vae", "model_index.json", "stagediff.json"))
    with torch.random.fork_rng(devices=[]):
        write_kontext_parts(FAMILIES["flux-kontext"], out, "tiny", 0, {})
    return out


@pytest.fixture(scope="session")
def flux_kontext_pipeline(flux_kontext_model: Path):
    from diffusers import FluxKontextPipeline

    pipeline = FluxKontextPipeline.from_pretrained(flux_kontext_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def z_image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("z-image", "tiny", tmp_path_factory.mktemp("models") / "z-image-tiny", seed=0)


@pytest.fixture(scope="session")
def z_image_pipeline(z_image_model: Path):
    from diffusers import ZImagePipeline

    pipeline = ZImagePipeline.from_pretrained(z_image_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def a14b_pipeline(a14b_model: Path):
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(a14b_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def qwen_pipeline(qwen_model: Path):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(qwen_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def klein_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 klein checkpoint of the step-distilled kind (model_index.json `is_distilled: true`)."""
    return init_model("flux2-klein", "tiny", tmp_path_factory.mktemp("models") / "klein-tiny", seed=0)


@pytest.fixture(scope="session")
def klein_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 klein checkpoint of the base kind (not distilled: CFG)."""
    return init_model("flux2-klein", "tiny-base", tmp_path_factory.mktemp("models") / "klein-base", seed=0)


@pytest.fixture(scope="session")
def klein_pipeline(klein_model: Path):
    from diffusers import Flux2KleinPipeline

    pipeline = Flux2KleinPipeline.from_pretrained(klein_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def klein_base_pipeline(klein_base_model: Path):
    from diffusers import Flux2KleinPipeline

    pipeline = Flux2KleinPipeline.from_pretrained(klein_base_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def reference_pipeline(tiny_model: Path):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def demo_pipeline():
    """The committed demo checkpoint (shapeworld/checkpoint) in diffusers' WanPipeline."""
    from diffusers import WanPipeline

    from shapeworld.demo_model import CHECKPOINT

    pipeline = WanPipeline.from_pretrained(CHECKPOINT)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture
def open_store() -> OpenStore:
    """How a test opens a job store (tests/helpers/store.py): the embedded one, unless a module overrides it."""
    return open_embedded


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """A real PostgreSQL server for the whole test session (tests/helpers/servers.py); each test makes its own
    database with `new_database`."""
    with postgres() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) for the whole test session; each test keeps to a prefix of its own."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
