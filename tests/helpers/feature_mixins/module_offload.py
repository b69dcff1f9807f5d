"""`--enable-cpu-offload`: ModuleOffloadTesterMixin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dit_svc import offload
from dit_svc.model_options import ModelOptions
from dit_svc.offload import ModuleOffloader, ResidencyCounter
from tests.helpers.feature_mixins.base import CPU, Reference, denoise_counting


class ModuleOffloadTesterMixin:
    """`--enable-cpu-offload`: the same latents, one expert on the device at a time, and each layer computes
    only while its expert is there. The offloader observed is the one the stage's options created."""

    def test_module_offload_leaves_latents_unchanged(
        self: Any, model_dir: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        created: list[ModuleOffloader] = []

        class RecordingOffloader(ModuleOffloader):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                created.append(self)

        monkeypatch.setattr(offload, "ModuleOffloader", RecordingOffloader)
        denoiser = self.build_denoiser(model_dir, torch.float32, ModelOptions(offload="module"))
        assert len(created) == 1, "the experts must share one offloader"
        offloader, experts = created[0], denoiser.experts
        assert list(offloader.units) == experts
        counter = ResidencyCounter(list(offloader.units.values()), experts, CPU)
        assert counter.onloaded == set()  # waits in CPU memory until its first forward
        latents, calls = denoise_counting(self, denoiser)
        print(f"module offload: {counter.onloads} onloads, {counter.offloads} offloads, {counter.leaf_calls} calls")
        assert calls == self.forwards_per_expert and torch.equal(latents, reference.latents)
        assert counter.violations == [] and counter.leaf_calls > 0
        assert counter.max_resident_blocks == 1
        # Each expert comes on once and replaces the one before: the steps of one expert move nothing.
        assert (counter.onloads, counter.offloads) == (len(experts), len(experts) - 1)
        assert offloader.active is offloader.units[experts[-1]]
        offloader.offload_all()
        assert counter.resident_blocks == 0
        counter.close()
