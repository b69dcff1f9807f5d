"""The serving features each family's DiT offers, one class per (family, feature): a tester config
(how to build and run the family) combined with a feature's mixin (its checks), both in
tests/helpers/feature_mixins/. The families' `Support` entries name these classes' tests.

Every check runs the family's tiny checkpoint on CPU and compares with the fp32 one-rank run of the same
request, which every module shares (one run per checkpoint); the quantized runs share one bf16 run, and the
parallel layouts of all families share one spawn of gloo ranks per world size, as do the step caches.
"""

from __future__ import annotations

from tests.helpers.feature_mixins import (
    BatchingTesterMixin,
    CompileTesterMixin,
    Flux2KleinTesterConfig,
    FluxKontextTesterConfig,
    FluxTesterConfig,
    GGUFTesterMixin,
    HunyuanVideo15I2VTesterConfig,
    HunyuanVideo15TesterConfig,
    LayerwiseOffloadTesterMixin,
    LoadingTesterMixin,
    LoRATesterMixin,
    LTX2TesterConfig,
    ModuleOffloadTesterMixin,
    ParallelLayoutsTesterMixin,
    QuantizationTesterMixin,
    QwenImage21TesterConfig,
    QwenImageEditPlusTesterConfig,
    QwenImageEditTesterConfig,
    QwenImageTesterConfig,
    StepCacheTesterMixin,
    StepSchedulingExpertsTesterMixin,
    StepSchedulingSchedulersTesterMixin,
    StepSchedulingTesterMixin,
    WanA14BTesterConfig,
    WanI2VA14BTesterConfig,
    WanI2VTesterConfig,
    WanT2VTesterConfig,
    WanTI2VTesterConfig,
    ZImageTesterConfig,
)


class TestWanT2VModuleOffload(WanT2VTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanT2VLayerwiseOffload(WanT2VTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanT2VQuantization(WanT2VTesterConfig, QuantizationTesterMixin):
    pass


class TestWanT2VLoading(WanT2VTesterConfig, LoadingTesterMixin):
    pass


class TestWanT2VParallelLayouts(WanT2VTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestWanT2VGGUF(WanT2VTesterConfig, GGUFTesterMixin):
    pass


class TestWanT2VBatching(WanT2VTesterConfig, BatchingTesterMixin):
    pass


class TestWanT2VStepCache(WanT2VTesterConfig, StepCacheTesterMixin):
    pass


class TestWanT2VCompile(WanT2VTesterConfig, CompileTesterMixin):
    pass


class TestWanT2VLoRA(WanT2VTesterConfig, LoRATesterMixin):
    pass


class TestWanT2VStepScheduling(WanT2VTesterConfig, StepSchedulingSchedulersTesterMixin):
    pass


class TestWanA14BStepScheduling(WanA14BTesterConfig, StepSchedulingExpertsTesterMixin):
    pass


class TestWanA14BModuleOffload(WanA14BTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanA14BLayerwiseOffload(WanA14BTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanA14BQuantization(WanA14BTesterConfig, QuantizationTesterMixin):
    pass


class TestWanA14BLoading(WanA14BTesterConfig, LoadingTesterMixin):
    pass


class TestWanA14BParallelLayouts(WanA14BTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestWanA14BGGUF(WanA14BTesterConfig, GGUFTesterMixin):
    pass


class TestWanA14BBatching(WanA14BTesterConfig, BatchingTesterMixin):
    pass


class TestWanA14BStepCache(WanA14BTesterConfig, StepCacheTesterMixin):
    pass


class TestWanI2VModuleOffload(WanI2VTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanI2VLayerwiseOffload(WanI2VTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanI2VQuantization(WanI2VTesterConfig, QuantizationTesterMixin):
    pass


class TestWanI2VLoading(WanI2VTesterConfig, LoadingTesterMixin):
    pass


class TestWanI2VParallelLayouts(WanI2VTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestWanI2VA14BModuleOffload(WanI2VA14BTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanI2VA14BLayerwiseOffload(WanI2VA14BTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanI2VA14BQuantization(WanI2VA14BTesterConfig, QuantizationTesterMixin):
    pass


class TestWanI2VA14BLoading(WanI2VA14BTesterConfig, LoadingTesterMixin):
    pass


class TestWanI2VA14BParallelLayouts(WanI2VA14BTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestWanTI2VModuleOffload(WanTI2VTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanTI2VLayerwiseOffload(WanTI2VTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanTI2VQuantization(WanTI2VTesterConfig, QuantizationTesterMixin):
    pass


class TestWanTI2VLoading(WanTI2VTesterConfig, LoadingTesterMixin):
    pass


class TestWanTI2VParallelLayouts(WanTI2VTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestQwenImageModuleOffload(QwenImageTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestQwenImageLayerwiseOffload(QwenImageTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestQwenImageQuantization(QwenImageTesterConfig, QuantizationTesterMixin):
    pass


class TestQwenImageLoading(QwenImageTesterConfig, LoadingTesterMixin):
    pass


class TestQwenImageParallelLayouts(QwenImageTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestQwenImageStepCache(QwenImageTesterConfig, StepCacheTesterMixin):
    pass


class TestQwenImageCompile(QwenImageTesterConfig, CompileTesterMixin):
    pass


class TestQwenImageLoRA(QwenImageTesterConfig, LoRATesterMixin):
    pass


class TestQwenImageStepScheduling(QwenImageTesterConfig, StepSchedulingTesterMixin):
    pass


class TestQwenImageEditModuleOffload(QwenImageEditTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestQwenImageEditLayerwiseOffload(QwenImageEditTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestQwenImageEditQuantization(QwenImageEditTesterConfig, QuantizationTesterMixin):
    pass


class TestQwenImageEditLoading(QwenImageEditTesterConfig, LoadingTesterMixin):
    pass


class TestQwenImageEditParallelLayouts(QwenImageEditTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestQwenImageEditPlusModuleOffload(QwenImageEditPlusTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestQwenImageEditPlusLayerwiseOffload(QwenImageEditPlusTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestQwenImageEditPlusQuantization(QwenImageEditPlusTesterConfig, QuantizationTesterMixin):
    pass


class TestQwenImageEditPlusLoading(QwenImageEditPlusTesterConfig, LoadingTesterMixin):
    pass


class TestQwenImageEditPlusParallelLayouts(QwenImageEditPlusTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestFluxModuleOffload(FluxTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestFluxLayerwiseOffload(FluxTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestFluxQuantization(FluxTesterConfig, QuantizationTesterMixin):
    pass


class TestFluxLoading(FluxTesterConfig, LoadingTesterMixin):
    pass


class TestFluxParallelLayouts(FluxTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestFluxStepCache(FluxTesterConfig, StepCacheTesterMixin):
    pass


class TestFluxCompile(FluxTesterConfig, CompileTesterMixin):
    pass


class TestFluxLoRA(FluxTesterConfig, LoRATesterMixin):
    pass


class TestFluxBatching(FluxTesterConfig, BatchingTesterMixin):
    pass


class TestZImageModuleOffload(ZImageTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestZImageLayerwiseOffload(ZImageTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestZImageLoading(ZImageTesterConfig, LoadingTesterMixin):
    pass


class TestZImageParallelLayouts(ZImageTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestZImageLoRA(ZImageTesterConfig, LoRATesterMixin):
    pass


class TestZImageBatching(ZImageTesterConfig, BatchingTesterMixin):
    pass


class TestZImageCompile(ZImageTesterConfig, CompileTesterMixin):
    pass


class TestFlux2KleinModuleOffload(Flux2KleinTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestFlux2KleinLayerwiseOffload(Flux2KleinTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestFlux2KleinQuantization(Flux2KleinTesterConfig, QuantizationTesterMixin):
    pass


class TestFlux2KleinLoading(Flux2KleinTesterConfig, LoadingTesterMixin):
    pass


class TestFlux2KleinParallelLayouts(Flux2KleinTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestFlux2KleinStepCache(Flux2KleinTesterConfig, StepCacheTesterMixin):
    pass


class TestFlux2KleinLoRA(Flux2KleinTesterConfig, LoRATesterMixin):
    pass


class TestFlux2KleinCompile(Flux2KleinTesterConfig, CompileTesterMixin):
    pass


class TestFluxKontextModuleOffload(FluxKontextTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestFluxKontextParallelLayouts(FluxKontextTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestQwenImage21ModuleOffload(QwenImage21TesterConfig, ModuleOffloadTesterMixin):
    pass


class TestQwenImage21ParallelLayouts(QwenImage21TesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestQwenImage21LayerwiseOffload(QwenImage21TesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestQwenImage21Loading(QwenImage21TesterConfig, LoadingTesterMixin):
    pass


class TestQwenImage21Quantization(QwenImage21TesterConfig, QuantizationTesterMixin):
    pass


class TestFluxKontextLayerwiseOffload(FluxKontextTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestFluxKontextQuantization(FluxKontextTesterConfig, QuantizationTesterMixin):
    pass


class TestFluxKontextLoading(FluxKontextTesterConfig, LoadingTesterMixin):
    pass


class TestFluxKontextStepCache(FluxKontextTesterConfig, StepCacheTesterMixin):
    pass


class TestFluxKontextCompile(FluxKontextTesterConfig, CompileTesterMixin):
    pass


class TestFluxKontextLoRA(FluxKontextTesterConfig, LoRATesterMixin):
    pass


class TestZImageQuantization(ZImageTesterConfig, QuantizationTesterMixin):
    pass


class TestHunyuanVideo15ParallelLayouts(HunyuanVideo15TesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestHunyuanVideo15ModuleOffload(HunyuanVideo15TesterConfig, ModuleOffloadTesterMixin):
    pass


class TestHunyuanVideo15LayerwiseOffload(HunyuanVideo15TesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestHunyuanVideo15Quantization(HunyuanVideo15TesterConfig, QuantizationTesterMixin):
    pass


class TestHunyuanVideo15Loading(HunyuanVideo15TesterConfig, LoadingTesterMixin):
    pass


class TestHunyuanVideo15Compile(HunyuanVideo15TesterConfig, CompileTesterMixin):
    pass


class TestHunyuanVideo15I2VParallelLayouts(HunyuanVideo15I2VTesterConfig, ParallelLayoutsTesterMixin):
    pass


class TestHunyuanVideo15I2VModuleOffload(HunyuanVideo15I2VTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestHunyuanVideo15I2VLayerwiseOffload(HunyuanVideo15I2VTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestHunyuanVideo15I2VQuantization(HunyuanVideo15I2VTesterConfig, QuantizationTesterMixin):
    pass


class TestHunyuanVideo15I2VLoading(HunyuanVideo15I2VTesterConfig, LoadingTesterMixin):
    pass


class TestHunyuanVideo15I2VCompile(HunyuanVideo15I2VTesterConfig, CompileTesterMixin):
    pass


class TestLTX2ModuleOffload(LTX2TesterConfig, ModuleOffloadTesterMixin):
    pass


class TestLTX2LayerwiseOffload(LTX2TesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestLTX2Quantization(LTX2TesterConfig, QuantizationTesterMixin):
    pass


class TestLTX2Loading(LTX2TesterConfig, LoadingTesterMixin):
    pass


class TestLTX2ParallelLayouts(LTX2TesterConfig, ParallelLayoutsTesterMixin):
    pass
