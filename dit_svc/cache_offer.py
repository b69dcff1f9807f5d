"""Which step caches the DiT offers for its checkpoint, and the one a request that names none gets.

A method is offered when the checkpoint's family supports it (its `first_block_cache`, `mag_cache` and
`teacache` features, each backed by tests) and, for MagCache, when the checkpoint has calibrated ratios
(`stagediff calibrate-cache` writes them; tools/calibrate.py). The stage reports the offer in
`ModelLimits.cache_methods` and `default_cache`, and the orchestrator and the stage check every request's
`cache` against it (services/validation.py resolve_cache). No torch here: the offer is settled, and a bad
flag refused, before the model loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from families.base import CACHE_FEATURES, DEFAULT_CACHE_THRESHOLDS, MAX_CACHE_THRESHOLD, Family
from stagediff.v1 import stages_pb2

# Written by `stagediff calibrate-cache` into the checkpoint, where the DiT looks for it by default.
MAG_RATIOS_FILE = "mag_ratios.json"
# One ratio per calibrated step; a file longer than any schedule is not one.
MAX_MAG_RATIOS = 1000


@dataclass(frozen=True)
class CacheOffer:
    thresholds: dict[str, float]  # offered method -> the threshold a request naming only the method gets
    default: stages_pb2.StepCache  # the cache of a request that names none
    # MagCache's ratios per expert ("transformer", "transformer_2"), None when mag is not offered.
    mag_ratios: dict[str, list[float]] | None = None

    def methods(self) -> list[stages_pb2.StepCache]:
        return [stages_pb2.StepCache(method=method, threshold=value) for method, value in self.thresholds.items()]


def load_mag_ratios(path: Path, experts: tuple[str, ...]) -> dict[str, list[float]]:
    """The prompt branch's ratios of each expert (diffusers' MagCacheConfig takes one list per model and
    resamples it to the request's step count); ValueError naming the file and what is wrong."""
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read MagCache ratios: {error}") from None
    by_expert = document.get("ratios") if isinstance(document, dict) else None
    if not isinstance(by_expert, dict):
        raise ValueError(f'{path}: expected {{"ratios": {{expert: {{"cond": [...]}}}}}} from calibrate-cache')
    ratios = {}
    for expert in experts:
        values = (by_expert.get(expert) or {}).get("cond") if isinstance(by_expert.get(expert), dict) else None
        if (
            not isinstance(values, list)
            or not 1 <= len(values) <= MAX_MAG_RATIOS
            or not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values)
        ):
            raise ValueError(
                f"{path}: ratios.{expert}.cond must be 1 to {MAX_MAG_RATIOS} positive finite numbers; "
                "run `stagediff calibrate-cache` again"
            )
        ratios[expert] = [float(v) for v in values]
    return ratios


def cache_offer_from(
    family: Family,
    experts: tuple[str, ...],
    *,
    model: Path,
    backend: str,
    threshold: float | None,
    mag_ratios_file: str | None,
) -> CacheOffer:
    """The offer for `--cache-backend`, `--cache-threshold` and `--cache-mag-ratios` (`mag_ratios_file`) for the
    checkpoint at `model`; ValueError naming the flag."""
    ratios_path = Path(mag_ratios_file) if mag_ratios_file else model / MAG_RATIOS_FILE
    mag_ratios = None
    thresholds = {}
    for method, feature in CACHE_FEATURES.items():
        if not family.support(feature).supported:
            continue
        if method == "mag":
            if not ratios_path.is_file():
                if mag_ratios_file:
                    raise ValueError(f"--cache-mag-ratios {mag_ratios_file}: no such file")
                continue
            mag_ratios = load_mag_ratios(ratios_path, experts)
        thresholds[method] = DEFAULT_CACHE_THRESHOLDS[method]
    method = backend
    if method != "none" and method not in thresholds:
        feature = CACHE_FEATURES[method]
        reason = (
            family.support(feature).reason
            if not family.support(feature).supported
            else f"no calibrated ratios at {ratios_path}; write them with `stagediff calibrate-cache --model DIR`"
        )
        raise ValueError(f"--cache-backend {method}: not offered for the {family.name} family: {reason}")
    if threshold is not None:
        if method == "none":
            raise ValueError("--cache-threshold needs --cache-backend first_block, mag or teacache")
        if not math.isfinite(threshold) or not 0 < threshold <= MAX_CACHE_THRESHOLD:
            raise ValueError(f"--cache-threshold {threshold}: use a value in (0, {MAX_CACHE_THRESHOLD:g}]")
    default = stages_pb2.StepCache(method=method)
    if method != "none":
        default.threshold = threshold if threshold is not None else thresholds[method]
    return CacheOffer(thresholds, default, mag_ratios)
