"""End to end with the DiT's memory options: an int8 transformer offloaded layer by layer serves frames close to
the unquantized pipeline's, and GGUF weights give diffusers' frames for the same file.

Each option alone and their combinations are proven below the service: offload (of a quantized transformer too)
in tests/unit/test_offload.py, fp8 and int8 in tests/unit/test_quantization.py, GGUF under offload and parallel
layouts in tests/integration/test_gguf.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel

from families.gguf import convert_checkpoint
from families.registry import FAMILIES
from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e


CASE = dict(
    prompt="a lighthouse at dusk",
    negative_prompt="blurry",
    height=48,
    width=80,
    num_frames=5,
    steps=2,
    guidance=5.0,
    seed=21,
)


def _generate(cluster: LocalCluster) -> tuple[np.ndarray, dict]:
    with Client(cluster.endpoint) as client:
        frames = client.generate(
            CASE["prompt"],
            negative_prompt=CASE["negative_prompt"],
            height=CASE["height"],
            width=CASE["width"],
            num_frames=CASE["num_frames"],
            num_inference_steps=CASE["steps"],
            guidance_scale=CASE["guidance"],
            seed=CASE["seed"],
        ).frames
        dit = next(s for s in client.cluster_info().stages if s.info.stage == "dit")
    return frames, dit


def test_offloaded_int8_dit_serves_close_frames(tiny_model, reference_pipeline, tmp_path) -> None:
    """Layerwise offload of an int8 transformer: frames close to the unquantized pipeline's."""
    offload = ["--enable-layerwise-offload", "--offload-blocks", "1"]
    with LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path,
        extra_args={"dit": [*offload, "--quantization", "int8", "--ignored-layers", "proj_out"]},
    ) as cluster:
        frames, dit = _generate(cluster)
    expected = reference_frames(reference_pipeline, **CASE).astype(np.float64)
    mse = np.mean((frames.astype(np.float64) - expected) ** 2)
    psnr = 10 * np.log10(255.0**2 / max(mse, 1e-12))
    assert psnr >= 30, f"PSNR {psnr:.1f} dB against the unquantized pipeline"
    assert dit.info.parallel_config["quantization"] == "int8"
    assert dit.info.parallel_config["offload"] == "layerwise"


def test_gguf_dit_serves_frames_equal_to_wan_pipeline(tiny_model, tmp_path) -> None:
    """A checkpoint whose transformer folder holds a Q4_0 GGUF file is served from it, frames as WanPipeline's
    with the transformer diffusers loads from the same file."""
    model = tmp_path / "gguf"
    shutil.copytree(tiny_model, model)
    (gguf_path,) = convert_checkpoint(model, FAMILIES["wan-t2v"], "Q4_0")
    with LocalCluster(model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path) as cluster:
        frames, dit = _generate(cluster)
    transformer = WanTransformer3DModel.from_single_file(
        str(gguf_path),
        config=str(model),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
    )
    expected = reference_frames(WanPipeline.from_pretrained(model, transformer=transformer), **CASE)
    assert np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max() <= 1
    assert dit.info.parallel_config["quantization"] == "gguf"
