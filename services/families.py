"""The model registry: each family, and which serving features it supports.

This table is the one place that says what works with what. The stages read it
to refuse unsupported flags at startup with the reason, `docs/features.md` is
generated from it (`python -m services.families > docs/features.md`), and a test
checks that the committed page matches and that every supported cell names a
test that exists.
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
    """A supported cell names the tests behind it (`path::test_name`); an unsupported one says why."""

    tests: tuple[str, ...] = ()
    reason: str = ""

    @property
    def supported(self) -> bool:
        return bool(self.tests)


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
_A14B = "tests/test_families.py::test_a14b_parallel_dit_equals_wan_pipeline"
_NOT_TESTED = "runs through the same code as wan-t2v but has no test with this family yet"
_QWEN_RING = "the joint text+image attention has a Ulysses processor only (image tokens split, text whole)"

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
                "ulysses": Support(tests=(_A14B,)),
                "cfg_parallel": Support(tests=(_A14B,)),
                "cpu_offload": Support(tests=("tests/test_offload.py::test_module_offload_keeps_one_expert_resident",)),
                "multithread_loading": Support(
                    tests=("tests/test_families.py::test_a14b_cluster_equals_wan_pipeline",)
                ),
                **{
                    name: Support(reason=_NOT_TESTED)
                    for name in (
                        "ring",
                        "tensor_parallel",
                        "hsdp",
                        "vae_patch_parallel",
                        "layerwise_offload",
                        "fp8",
                        "int8",
                        "interpolation",
                    )
                },
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
                "ring": Support(reason=_QWEN_RING + "; refused at startup"),
                "tensor_parallel": Support(
                    reason="no tensor-parallel plan for QwenImage blocks yet; refused at startup"
                ),
                "hsdp": Support(reason="not wired for QwenImage blocks yet; refused at startup"),
                "vae_patch_parallel": Support(reason="AutoencoderKLQwenImage decodes whole images; refused at startup"),
                "interpolation": Support(reason="single images: nothing to interpolate"),
                **{
                    name: Support(reason=_NOT_TESTED.replace("wan-t2v", "the Wan families"))
                    for name in ("cpu_offload", "layerwise_offload", "fp8", "int8")
                },
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
        "a test fails when this page and the registry disagree, and when a supported cell has no test behind it.",
        "",
        "| feature | " + " | ".join(FAMILIES) + " |",
        "| --- | " + " | ".join("---" for _ in FAMILIES) + " |",
    ]
    for key, title in FEATURES.items():
        cells = []
        for family in FAMILIES.values():
            support = family.support(key)
            cells.append("yes" if support.supported else f"no: {support.reason}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", "## Tests behind each supported cell", ""]
    for family in FAMILIES.values():
        lines.append(f"### {family.name} ({family.pipeline})")
        lines.append("")
        lines.append(family.description)
        lines.append("")
        for key in FEATURES:
            support = family.support(key)
            if support.supported:
                lines.append(f"- {FEATURES[key]}: " + ", ".join(f"`{test}`" for test in support.tests))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
