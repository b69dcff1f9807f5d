"""Model families beyond Wan2.1 through the running cluster: Wan2.2-T2V-A14B (two experts) and Qwen-Image
(text-to-image, true CFG) equal the in-process pipeline's frames within one level: A14B on its default cluster,
Qwen-Image beside two Wan models in tests/e2e/test_e2e_models.py, and here on one parallel cluster that combines
the DiT layouts with a patch-parallel VAE (the image family and its own VAE; a parallel Wan cluster runs in
tests/e2e/test_e2e_parallel.py). Each layout alone and combined is proven against one rank on gloo for both
families in tests/integration/test_family_features.py (the ParallelLayouts classes, A14B's experts switching on
every rank included), Qwen-Image's VAE in tests/integration/test_qwen_vae_patch_parallel.py and A14B's in
tests/integration/test_family_a14b_features.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from tests.helpers.image_to_video import PATCH_PARALLEL_VAE, ULYSSES_CFG_HSDP
from tests.helpers.qwen_references import QWEN_CASES, assert_close, generate, qwen_reference
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE


def _cluster(model: Path, log_dir: Path, extra_args: dict[str, list[str]] | None = None) -> Iterator[LocalCluster]:
    local = LocalCluster(model, threads_per_stage=THREADS_PER_STAGE, log_dir=log_dir, extra_args=extra_args or {})
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def a14b_cluster(a14b_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from _cluster(a14b_model, tmp_path_factory.mktemp("a14b-cluster-logs"))


@pytest.mark.e2e
def test_qwen_parallel_dit_and_vae_equal_pipeline(qwen_model, qwen_pipeline, tmp_path: Path) -> None:
    """4 DiT ranks (Ulysses, CFG-parallel, HSDP sharded over two) and the VAE decoding in bands over two."""
    # 48x80 packs into 3x5 = 15 image tokens, which 2 does not divide (padded and masked); 80x32 (tall, 10 latent
    # rows) runs true CFG with the prompt's embeddings masked. (64x64 with true CFG runs on the default cluster.)
    flags = {"dit": ULYSSES_CFG_HSDP, "vae": PATCH_PARALLEL_VAE}
    for cluster in _cluster(qwen_model, tmp_path, flags):
        for case in QWEN_CASES[1:3]:
            frames = generate(cluster.endpoint, case)
            expected = qwen_reference(qwen_pipeline, **case)
            levels = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
            print(f"{case['height']}x{case['width']}: {levels} levels off QwenImagePipeline")
            assert_close(frames, expected)
        with Client(cluster.endpoint) as client:
            stages = {s.info.stage: s.info for s in client.cluster_info().stages}
    assert stages["dit"].parallel_config["ulysses_degree"] == "2"
    assert stages["dit"].parallel_config["cfg_parallel_size"] == "2"
    assert stages["vae"].parallel_config["vae_patch_parallel_size"] == "2"
    assert stages["vae"].limits.min_height == 16


# Two UniPC steps run 999 (>= 875: transformer) then 750 (transformer_2); four run 999, 900, 750, 500.
A14B_CASES = [
    dict(
        prompt="a red fox running through snow",
        negative_prompt="blurry, low quality",
        height=64,
        width=64,
        num_frames=9,
        steps=2,
        guidance=5.0,
        seed=0,
    ),
    dict(
        prompt="a lighthouse at dusk",
        negative_prompt="",
        height=48,
        width=80,
        num_frames=5,
        steps=4,
        guidance=1.0,
        seed=1234,
    ),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", A14B_CASES, ids=[f"{c['steps']}steps-cfg{c['guidance']}" for c in A14B_CASES])
def test_a14b_cluster_equals_wan_pipeline(a14b_cluster, a14b_pipeline, case) -> None:
    assert_close(generate(a14b_cluster.endpoint, case), reference_frames(a14b_pipeline, **case))
