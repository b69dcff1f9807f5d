"""The crop-bucket rule a family may take its output size from an input image by (families/base.py `crop_bucket`,
`SizeFromImage(buckets=True)`): HunyuanVideo 1.5's image processor's pick, for every aspect ratio."""

from __future__ import annotations

import random

import pytest
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

from families.base import SizeFromImage, crop_bucket


@pytest.mark.parametrize("base", [64, 256, 640, 960])
def test_crop_bucket_is_the_hunyuanvideo_processors_pick(base: int) -> None:
    """Random image sizes, squares and extreme ratios: the bucket equals calculate_default_height_width's."""
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    rng = random.Random(base)
    sizes = [(rng.randint(16, 4000), rng.randint(16, 4000)) for _ in range(200)]
    sizes += [(500, 500), (4000, 16), (16, 4000), (1920, 1080), (1080, 1920)]
    for width, height in sizes:
        picked_width, picked_height = crop_bucket(width, height, base, 16)
        assert (picked_height, picked_width) == processor.calculate_default_height_width(height, width, base)
        # A landscape image gets a landscape (or square) bucket, a portrait one a portrait bucket.
        assert (picked_width >= picked_height) == (width >= height) or picked_width == picked_height


def test_bucket_rule_takes_the_models_base() -> None:
    rule = SizeFromImage(area=0, multiple=0, buckets=True, fixed=True)
    assert rule.size(100, 70, model_multiple=16, base=64) == (64, 48)
    assert rule.size(1920, 1080, model_multiple=16, base=640) == (848, 480)
    with pytest.raises(ValueError, match="image_size_base"):
        rule.size(100, 70, model_multiple=16)
