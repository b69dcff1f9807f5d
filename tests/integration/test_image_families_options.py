"""The DiT and VAE startup checks on the image-conditioned families' tiny checkpoints: the DiT accepts every
parallel layout and memory option the families claim in docs/features.md, and the VAE refuses tiling, naming
the family's reason. (What those options compute is tested per feature in tests/integration/
test_family_features.py.)
"""

from __future__ import annotations

import pytest

from tests.helpers.feature_mixins.base import tiny_checkpoint
from tests.helpers.qwen_image_edit import PARALLEL_SPECS as EDIT_SPECS
from tests.helpers.wan_i2v import PARALLEL_SPECS as WAN_SPECS

FAMILY_NAMES = [*WAN_SPECS, *EDIT_SPECS]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_claimed_dit_options_pass_the_startup_checks(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    """Every parallel layout and memory option the family claims (docs/features.md) passes the DiT's checks."""
    from dit_svc.config import DitConfig
    from tests.helpers.serving import parse_serve

    model_dir = tiny_checkpoint(family, tmp_path_factory)
    for flags in (
        ["--ulysses-degree", "2"],
        ["--ring-degree", "2"],
        ["--cfg-parallel-size", "2"],
        ["--tensor-parallel-size", "2"],
        ["--use-hsdp", "--hsdp-shard-size", "2"],
        ["--enable-cpu-offload"],
        ["--enable-layerwise-offload"],
        ["--quantization", "fp8"],
        ["--quantization", "int8"],
    ):
        DitConfig.from_args(parse_serve(["dit", "--model", str(model_dir), *flags]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_vae_tiling_is_refused_at_startup(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    from families.registry import FAMILIES
    from tests.helpers.serving import parse_serve
    from vae_svc.config import VaeConfig

    model_dir = tiny_checkpoint(family, tmp_path_factory)
    assert FAMILIES[family].support("vae_tiling").refused_at_startup
    args = parse_serve(["vae", "--model", str(model_dir), "--vae-use-tiling"])
    with pytest.raises(SystemExit) as refused:
        VaeConfig.from_args(args)
    assert f"the {family} family does not support" in str(refused.value), str(refused.value)
    assert FAMILIES[family].support("vae_tiling").reason in str(refused.value), str(refused.value)
    VaeConfig.from_args(parse_serve(["vae", "--model", str(model_dir), "--vae-patch-parallel-size", "2"]))
