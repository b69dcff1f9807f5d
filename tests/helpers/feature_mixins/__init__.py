"""The family x feature matrix as tests: one tester config per family, one mixin per feature.

A tester config (configs.py, on the interface of base.py's FamilyTesterConfig) says how to test one family's
DiT: which checkpoint, which request (`spec`), how to build its denoiser, what conditioning to feed it, how
many forwards each expert runs, where its blocks are and which layers `--ignored-layers` patterns keep. A
mixin (one module per feature) holds one feature's checks, written once against that interface; a test class
combines the two (`class TestQwenImageOffload(QwenImageTesterConfig, ModuleOffloadTesterMixin)`), and a
family's `Support` entries name the class's tests. tests/unit/test_families.py checks that a supported cell of
a feature in FEATURE_MIXINS names a class that mixes in that feature's mixin.

Adding a family: write its tester config (a subclass of FamilyTesterConfig in configs.py, or in a module of its
own beside it, configs_<family>.py, as the image families' are), add it to TESTER_CONFIGS, and list its test classes
beside the others
(tests/integration/test_family_features.py).
Tester configs are importable by their qualified name: rank processes receive them by reference.
"""

from __future__ import annotations

from tests.helpers.feature_mixins.base import (
    CPU,
    FamilyTesterConfig,
    Reference,
    assert_same_tensors,
    denoise_counting,
    reference_run,
)
from tests.helpers.feature_mixins.batching import BatchingTesterMixin
from tests.helpers.feature_mixins.compile import CompileTesterMixin
from tests.helpers.feature_mixins.configs import TESTER_CONFIGS as _CONFIGS
from tests.helpers.feature_mixins.configs import (
    QwenImageEditPlusTesterConfig,
    QwenImageEditTesterConfig,
    QwenImageTesterConfig,
    WanA14BTesterConfig,
    WanI2VA14BTesterConfig,
    WanI2VTesterConfig,
    WanT2VTesterConfig,
    WanTI2VTesterConfig,
)
from tests.helpers.feature_mixins.configs_flux import FluxTesterConfig
from tests.helpers.feature_mixins.configs_flux2_klein import Flux2KleinTesterConfig
from tests.helpers.feature_mixins.configs_flux_kontext import FluxKontextTesterConfig
from tests.helpers.feature_mixins.configs_hunyuanvideo_15 import (
    HunyuanVideo15I2VTesterConfig,
    HunyuanVideo15TesterConfig,
)
from tests.helpers.feature_mixins.configs_ltx2 import LTX2TesterConfig
from tests.helpers.feature_mixins.configs_qwen_image_21 import QwenImage21TesterConfig
from tests.helpers.feature_mixins.configs_z_image import ZImageTesterConfig
from tests.helpers.feature_mixins.gguf import GGUFTesterMixin
from tests.helpers.feature_mixins.layerwise_offload import LayerwiseOffloadTesterMixin
from tests.helpers.feature_mixins.loading import LoadingTesterMixin
from tests.helpers.feature_mixins.lora import LoRATesterMixin
from tests.helpers.feature_mixins.module_offload import ModuleOffloadTesterMixin
from tests.helpers.feature_mixins.parallel_layouts import ParallelLayoutsTesterMixin
from tests.helpers.feature_mixins.quantization import QuantizationTesterMixin
from tests.helpers.feature_mixins.step_cache import StepCacheTesterMixin
from tests.helpers.feature_mixins.step_scheduling import (
    StepSchedulingExpertsTesterMixin,
    StepSchedulingSchedulersTesterMixin,
    StepSchedulingTesterMixin,
)

# Every family's tester config: configs.py's, then those kept in modules of their own.
TESTER_CONFIGS: tuple[type[FamilyTesterConfig], ...] = (
    *_CONFIGS,
    FluxTesterConfig,
    ZImageTesterConfig,
    Flux2KleinTesterConfig,
    FluxKontextTesterConfig,
    QwenImage21TesterConfig,
    HunyuanVideo15TesterConfig,
    HunyuanVideo15I2VTesterConfig,
    LTX2TesterConfig,
)

# The feature whose supported cells must name a test class that mixes in this mixin (tests/unit/test_families.py).

FEATURE_MIXINS: dict[str, type] = {
    "cpu_offload": ModuleOffloadTesterMixin,
    "layerwise_offload": LayerwiseOffloadTesterMixin,
    "fp8": QuantizationTesterMixin,
    "int8": QuantizationTesterMixin,
    "multithread_loading": LoadingTesterMixin,
    "ulysses": ParallelLayoutsTesterMixin,
    "ring": ParallelLayoutsTesterMixin,
    "cfg_parallel": ParallelLayoutsTesterMixin,
    "tensor_parallel": ParallelLayoutsTesterMixin,
    "hsdp": ParallelLayoutsTesterMixin,
    "gguf": GGUFTesterMixin,
    "batching": BatchingTesterMixin,
    "compile": CompileTesterMixin,
    "first_block_cache": StepCacheTesterMixin,
    "mag_cache": StepCacheTesterMixin,
    "teacache": StepCacheTesterMixin,
    "lora": LoRATesterMixin,
    "step_scheduling": StepSchedulingTesterMixin,
}

__all__ = [
    "BatchingTesterMixin",
    "CPU",
    "CompileTesterMixin",
    "FEATURE_MIXINS",
    "TESTER_CONFIGS",
    "FamilyTesterConfig",
    "FluxTesterConfig",
    "FluxKontextTesterConfig",
    "Flux2KleinTesterConfig",
    "HunyuanVideo15I2VTesterConfig",
    "HunyuanVideo15TesterConfig",
    "GGUFTesterMixin",
    "LTX2TesterConfig",
    "LayerwiseOffloadTesterMixin",
    "LoRATesterMixin",
    "LoadingTesterMixin",
    "ModuleOffloadTesterMixin",
    "ParallelLayoutsTesterMixin",
    "QuantizationTesterMixin",
    "QwenImage21TesterConfig",
    "QwenImageEditPlusTesterConfig",
    "QwenImageEditTesterConfig",
    "QwenImageTesterConfig",
    "Reference",
    "StepCacheTesterMixin",
    "StepSchedulingExpertsTesterMixin",
    "StepSchedulingSchedulersTesterMixin",
    "StepSchedulingTesterMixin",
    "WanA14BTesterConfig",
    "WanI2VA14BTesterConfig",
    "WanI2VTesterConfig",
    "WanT2VTesterConfig",
    "WanTI2VTesterConfig",
    "ZImageTesterConfig",
    "assert_same_tensors",
    "denoise_counting",
    "reference_run",
]
