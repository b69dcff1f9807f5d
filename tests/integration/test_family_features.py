"""The serving features each family's DiT offers, one class per (family, feature): a tester config
(how to build and run the family) combined with a feature's mixin (its checks), both in
tests/helpers/feature_mixins.py. The families' `Support` entries name these classes' tests.

Every check runs the family's tiny checkpoint on one CPU rank and compares with the fp32 run of the same
request, which every module shares (one run per checkpoint).
"""

from __future__ import annotations

from tests.helpers.feature_mixins import (
    LayerwiseOffloadTesterMixin,
    LoadingTesterMixin,
    ModuleOffloadTesterMixin,
    QuantizationTesterMixin,
    QwenImageTesterConfig,
    WanA14BTesterConfig,
)


class TestWanA14BModuleOffload(WanA14BTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestWanA14BLayerwiseOffload(WanA14BTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestWanA14BQuantization(WanA14BTesterConfig, QuantizationTesterMixin):
    pass


class TestWanA14BLoading(WanA14BTesterConfig, LoadingTesterMixin):
    pass


class TestQwenImageModuleOffload(QwenImageTesterConfig, ModuleOffloadTesterMixin):
    pass


class TestQwenImageLayerwiseOffload(QwenImageTesterConfig, LayerwiseOffloadTesterMixin):
    pass


class TestQwenImageQuantization(QwenImageTesterConfig, QuantizationTesterMixin):
    pass


class TestQwenImageLoading(QwenImageTesterConfig, LoadingTesterMixin):
    pass
