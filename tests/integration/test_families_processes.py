"""Model families beyond Wan2.1 in rank groups and stage processes: Qwen-Image's Ulysses transformer equals
one rank's, and its VAE refuses tiling at startup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from families.qwen_image.family import QWEN_IMAGE
from families.qwen_image.init_model import TRANSFORMER_CONFIGS as QWEN_TRANSFORMER_CONFIGS


def _qwen_ulysses_ranks(rank: int, world_size: int, config: dict, cases: list) -> list[torch.Tensor]:
    from diffusers import QwenImageTransformer2DModel

    from families.qwen_image.parallel import parallelize
    from stagekit.parallel import ParallelConfig, build_mesh

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**config).eval()
    parallel = ParallelConfig(ulysses_degree=world_size)
    parallelize(model, parallel, build_mesh(parallel, "cpu"), torch.device("cpu"))
    with torch.no_grad():
        return [model(**inputs, return_dict=False)[0] for inputs in cases]


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_qwen_ulysses_transformer_equals_one_rank(zero_cond_t: bool) -> None:
    from diffusers import QwenImageTransformer2DModel

    from stagekit.parallel.launch import run_ranks

    config = dict(QWEN_TRANSFORMER_CONFIGS["tiny"], zero_cond_t=zero_cond_t)
    generator = torch.Generator().manual_seed(1)
    cases = []
    # (rows, columns, text mask): 15 image tokens (padded to 16) and 16, with and without text padding
    for rows, columns, mask in ((3, 5, [1, 1, 1, 1, 1, 0, 0]), (4, 4, None), (3, 5, None)):
        shapes = [(1, rows, columns)] * (2 if zero_cond_t else 1)
        cases.append(
            dict(
                hidden_states=torch.randn(1, rows * columns * len(shapes), config["in_channels"], generator=generator),
                encoder_hidden_states=torch.randn(1, 7, config["joint_attention_dim"], generator=generator),
                encoder_hidden_states_mask=None if mask is None else torch.tensor([mask]),
                timestep=torch.tensor([0.5]),
                img_shapes=[shapes],
            )
        )
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**config).eval()
    with torch.no_grad():
        expected = [model(**inputs, return_dict=False)[0] for inputs in cases]
    for outputs in run_ranks(_qwen_ulysses_ranks, 2, config, cases):
        for output, reference in zip(outputs, expected, strict=True):
            torch.testing.assert_close(output, reference, rtol=0, atol=1e-5)


def _serve_refused(stage: str, model: Path, flags: list[str]) -> str:
    """`stagediff serve STAGE` with the flags; it must exit at startup with an error. Returns its stderr."""
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "serve", stage, "--model", str(model), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0, completed.stderr
    return completed.stderr


@pytest.mark.e2e
def test_qwen_vae_refuses_tiling_at_startup(qwen_model) -> None:
    stderr = _serve_refused("vae", qwen_model, ["--vae-use-tiling"])
    expected = (
        "stagediff serve vae: the qwen-image family does not support --vae-use-tiling: "
        + QWEN_IMAGE.support("vae_tiling").reason
    )
    assert expected in stderr, stderr
