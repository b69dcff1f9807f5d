"""The model registry: each family, and which serving features it supports.

This table is the one place that says what works with what. `docs/features.md` is
generated from it (`python -m services.families > docs/features.md`); tests check that
the committed page matches, that every supported cell names a test that exists, and
that every flag refused at startup names the tests of its refusal. The DiT stage
refuses the parallel methods qwen-image does not run with the reasons kept here
(`QWEN_REASONS`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

FEATURES = {
    "ulysses": "Ulysses SP (`--ulysses-degree`)",
    "ring": "Ring SP (`--ring-degree`)",
    "cfg_parallel": "CFG-parallel (`--cfg-parallel-size 2`)",
    "tensor_parallel": "Tensor parallel (`--tensor-parallel-size`)",
    "hsdp": "HSDP (`--use-hsdp`)",
    "vae_patch_parallel": "VAE patch parallel (`--vae-patch-parallel-size`)",
    "cpu_offload": "Module-wise CPU offload (`--enable-cpu-offload`)",
    "layerwise_offload": "Layerwise offload (`--enable-layerwise-offload`)",
    "fp8": "FP8 weights (`--quantization fp8`)",
    "int8": "INT8 weights (`--quantization int8`)",
    "multithread_loading": "Multi-thread loading (`--num-weight-load-threads`)",
    "interpolation": "Frame interpolation (`--interp-exp`)",
}


@dataclass(frozen=True)
class Support:
    """A supported cell names the tests behind it (`path::test_name`); an unsupported one says why.

    An unsupported cell whose flag the stage refuses at startup names the tests of that refusal in
    `refusal_tests`, so that a user who passes the flag anyway gets an error, never a wrong result.
    """

    tests: tuple[str, ...] = ()
    reason: str = ""
    refusal_tests: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return bool(self.tests)

    @property
    def refused_at_startup(self) -> bool:
        return not self.supported and bool(self.refusal_tests)

    def cell(self) -> str:
        """The table cell: "yes", or "no: " with the reason (and how the stage refuses the flag)."""
        if self.supported:
            return "yes"
        return f"no: {self.reason}; refused at startup" if self.refused_at_startup else f"no: {self.reason}"


@dataclass(frozen=True)
class Family:
    name: str
    pipeline: str  # the diffusers pipeline class that is the reference for correctness
    description: str
    features: dict[str, Support] = field(default_factory=dict)

    def support(self, feature: str) -> Support:
        return self.features.get(feature, Support(reason="not implemented for this family yet"))

    def refuse_unsupported(self, feature: str) -> None:
        """Raises ValueError with the reason when the family cannot serve a feature."""
        support = self.support(feature)
        if not support.supported:
            raise ValueError(f"{FEATURES[feature]} is not supported for {self.name}: {support.reason}")


_WAN_TESTS = {
    "ulysses": (
        "tests/test_dit_parallel.py::test_parallel_latents_equal_one_rank",
        "tests/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "ring": (
        "tests/test_dit_parallel.py::test_parallel_latents_equal_one_rank",
        "tests/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "cfg_parallel": (
        "tests/test_dit_parallel.py::test_parallel_latents_equal_one_rank",
        "tests/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "tensor_parallel": (
        "tests/test_tensor_parallel_hsdp.py::test_tensor_parallel_2_matches_single_rank",
        "tests/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "hsdp": (
        "tests/test_tensor_parallel_hsdp.py::test_hsdp_shard_2_matches_single_rank_and_halves_parameters",
        "tests/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "vae_patch_parallel": (
        "tests/test_vae_patch_parallel.py::test_patch_parallel_equals_untiled_decode",
        "tests/test_e2e_vae_interp.py::test_patch_parallel_vae_frames_equal_wan_pipeline",
    ),
    "interpolation": (
        "tests/test_e2e_parity.py::test_interpolation_keeps_originals_in_place",
        "tests/test_e2e_vae_interp.py::test_learned_interpolator_through_the_cluster",
    ),
    "cpu_offload": (
        "tests/test_offload.py::test_transformer_output_unchanged",
        "tests/test_e2e_memory.py::test_offload_leaves_frames_equal_to_wan_pipeline",
    ),
    "layerwise_offload": (
        "tests/test_offload.py::test_layerwise_keeps_at_most_n_blocks_resident",
        "tests/test_e2e_memory.py::test_offload_leaves_frames_equal_to_wan_pipeline",
    ),
    "fp8": (
        "tests/test_quantization.py::test_parameter_bytes_at_most_55_percent_of_bf16",
        "tests/test_e2e_memory.py::test_quantized_dit_serves_close_frames_and_halves_weights",
    ),
    "int8": (
        "tests/test_quantization.py::test_parameter_bytes_at_most_55_percent_of_bf16",
        "tests/test_e2e_memory.py::test_quantized_dit_serves_close_frames_and_halves_weights",
    ),
    "multithread_loading": (
        "tests/test_weights.py::test_matches_from_pretrained",
        "tests/test_e2e_parity.py::test_cluster_frames_equal_wan_pipeline",
    ),
}
_A14B_E2E = "tests/test_families.py::test_a14b_parallel_dit_equals_wan_pipeline"
_A14B = "tests/test_family_a14b_features.py::"
_QWEN = "tests/test_family_qwen_features.py::"
_QWEN_LAYOUT_REFUSAL = "tests/test_families.py::test_qwen_dit_layout_check_refuses_ring_tensor_and_hsdp"
_QWEN_DENOISER_REFUSAL = _QWEN + "test_qwen_denoiser_refuses_ring_tensor_and_hsdp"
_QWEN_QUANTIZATION = (
    _QWEN + "test_qwen_quantized_parameter_bytes_and_ignored_layers",
    _QWEN + "test_qwen_quantized_denoiser_stays_close",
    _QWEN + "test_qwen_ignored_layers_are_checked_against_qwen_layer_names",
)

# Why qwen-image does not run these; dit_svc/qwen_denoise.py refuses the DiT flags with these words.
QWEN_REASONS = {
    "ring": "the joint text+image attention has a Ulysses processor only (image tokens split, text whole)",
    "tensor_parallel": "the tensor-parallel plan covers WanTransformer3DModel blocks only, not QwenImage's",
    "hsdp": "HSDP shards WanTransformer3DModel blocks only, not QwenImage's",
    "vae_patch_parallel": "patch-parallel decode is implemented for the Wan VAE only; AutoencoderKLQwenImage "
    "decodes each image whole on one device",
}

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            name="wan-t2v",
            pipeline="WanPipeline",
            description="Wan2.1 text-to-video (UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan)",
            features={name: Support(tests=tests) for name, tests in _WAN_TESTS.items()},
        ),
        Family(
            name="wan2.2-a14b",
            pipeline="WanPipeline (transformer_2, boundary_ratio)",
            description="Wan2.2 A14B text-to-video: two expert transformers switched at a boundary timestep",
            features={
                "ulysses": Support(tests=(_A14B_E2E,)),
                "ring": Support(tests=(_A14B + "test_a14b_ring_latents_equal_one_rank",)),
                "cfg_parallel": Support(tests=(_A14B_E2E,)),
                "tensor_parallel": Support(tests=(_A14B + "test_a14b_tensor_parallel_latents_equal_one_rank",)),
                "hsdp": Support(tests=(_A14B + "test_a14b_hsdp_latents_equal_one_rank_and_halve_each_expert",)),
                "vae_patch_parallel": Support(tests=(_A14B + "test_a14b_patch_parallel_vae_equals_whole_decode",)),
                "cpu_offload": Support(
                    tests=(
                        "tests/test_offload.py::test_module_offload_keeps_one_expert_resident",
                        _A14B + "test_a14b_module_offload_keeps_one_expert_resident",
                    )
                ),
                "layerwise_offload": Support(tests=(_A14B + "test_a14b_layerwise_offload_keeps_n_blocks_per_expert",)),
                "fp8": Support(tests=(_A14B + "test_a14b_quantized_experts_halve_bytes_and_stay_close",)),
                "int8": Support(tests=(_A14B + "test_a14b_quantized_experts_halve_bytes_and_stay_close",)),
                "multithread_loading": Support(
                    tests=(
                        _A14B + "test_a14b_experts_load_like_from_pretrained",
                        "tests/test_families.py::test_a14b_cluster_equals_wan_pipeline",
                    )
                ),
                "interpolation": Support(tests=(_A14B + "test_a14b_interpolation_keeps_decoded_frames_in_place",)),
            },
        ),
        Family(
            name="qwen-image",
            pipeline="QwenImagePipeline",
            description="Qwen-Image text-to-image with true CFG (Qwen2.5-VL text encoder, QwenImageTransformer2DModel)",
            features={
                "cfg_parallel": Support(tests=("tests/test_families.py::test_qwen_cfg_parallel_equals_pipeline",)),
                "ulysses": Support(
                    tests=(
                        "tests/test_families.py::test_qwen_ulysses_equals_pipeline",
                        "tests/test_families.py::test_qwen_ulysses_transformer_equals_one_rank",
                    )
                ),
                "ring": Support(
                    reason=QWEN_REASONS["ring"],
                    refusal_tests=(
                        _QWEN_LAYOUT_REFUSAL,
                        "tests/test_families.py::test_qwen_dit_refuses_ring_at_startup",
                        _QWEN_DENOISER_REFUSAL,
                    ),
                ),
                "tensor_parallel": Support(
                    reason=QWEN_REASONS["tensor_parallel"],
                    refusal_tests=(_QWEN_LAYOUT_REFUSAL, _QWEN_DENOISER_REFUSAL),
                ),
                "hsdp": Support(
                    reason=QWEN_REASONS["hsdp"], refusal_tests=(_QWEN_LAYOUT_REFUSAL, _QWEN_DENOISER_REFUSAL)
                ),
                "vae_patch_parallel": Support(
                    reason=QWEN_REASONS["vae_patch_parallel"],
                    refusal_tests=(
                        "tests/test_families.py::test_qwen_vae_refuses_patch_parallel_at_startup",
                        _QWEN + "test_qwen_vae_decode_check_refuses_patch_parallel",
                    ),
                ),
                "cpu_offload": Support(tests=(_QWEN + "test_qwen_module_offload_leaves_latents_unchanged",)),
                "layerwise_offload": Support(
                    tests=(_QWEN + "test_qwen_layerwise_offload_keeps_at_most_n_blocks_resident",)
                ),
                "fp8": Support(tests=_QWEN_QUANTIZATION),
                "int8": Support(tests=_QWEN_QUANTIZATION),
                "multithread_loading": Support(
                    tests=(
                        _QWEN + "test_qwen_components_load_like_from_pretrained",
                        _QWEN + "test_qwen_stages_read_weights_with_their_load_threads",
                    )
                ),
                "interpolation": Support(
                    reason="single images: nothing to interpolate; a request asking for it is refused with "
                    "INVALID_ARGUMENT"
                ),
            },
        ),
    )
}


def render_markdown() -> str:
    """The feature compatibility table as docs/features.md shows it."""
    lines = [
        "# Feature compatibility",
        "",
        "Generated from the model registry (`services/families.py`) by `python -m services.families`;",
        "a test fails when this page and the registry disagree, and when a supported cell or a refusal",
        "has no test behind it.",
        "",
        "| feature | " + " | ".join(FAMILIES) + " |",
        "| --- | " + " | ".join("---" for _ in FAMILIES) + " |",
    ]
    for key, title in FEATURES.items():
        cells = []
        for family in FAMILIES.values():
            cells.append(family.support(key).cell())
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", "## Tests behind each supported cell and each refusal", ""]
    for family in FAMILIES.values():
        lines.append(f"### {family.name} ({family.pipeline})")
        lines.append("")
        lines.append(family.description)
        lines.append("")
        for key in FEATURES:
            support = family.support(key)
            if support.supported:
                lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in support.tests))
        refused = [key for key in FEATURES if family.support(key).refused_at_startup]
        if refused:
            lines += ["", "Refused at startup, and the tests of each refusal:", ""]
            for key in refused:
                tests = family.support(key).refusal_tests
                lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in tests))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
