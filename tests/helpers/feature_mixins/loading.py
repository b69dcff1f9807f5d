"""`--num-weight-load-threads`: LoadingTesterMixin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagekit.weights import load_stats
from tests.helpers.feature_mixins.base import assert_same_tensors


class LoadingTesterMixin:
    """`--num-weight-load-threads`: the DiT's loader reads every expert with its thread count, and each holds
    exactly the pipeline's (from_pretrained) weights."""

    @pytest.mark.parametrize("load_threads", [1, 4])
    def test_denoiser_loads_like_from_pretrained(
        self: Any, model_dir: Path, request: pytest.FixtureRequest, load_threads: int
    ) -> None:
        expected = self.reference_experts(request, model_dir)
        denoiser = self.build_denoiser(model_dir, torch.float32, load_threads=load_threads)
        for name, expert, reference in zip(self.expert_names, denoiser.experts, expected, strict=True):
            assert load_stats(expert).threads == load_threads, name
            assert_same_tensors(expert, reference, name)
        if len(denoiser.experts) > 1:
            first, second = (dict(expert.named_parameters()) for expert in denoiser.experts[:2])
            assert not torch.equal(first[self.distinct_weight], second[self.distinct_weight])
