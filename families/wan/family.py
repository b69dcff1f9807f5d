"""Wan text-to-video: Wan2.1 (`wan-t2v`) and Wan2.2 A14B, two experts switched at a boundary timestep.

Declarations only (no torch); the compute is beside this file: encode.py (UMT5), denoise.py (the loop,
one or two experts), parallel.py (the parallel plan), decode.py (the streaming causal VAE), checkpoint.py
and init_model.py.
"""

from __future__ import annotations

from typing import Any

from families.base import LORA_UNVERIFIED, Family, RequestDefaults, Support, TensorSlot

CHAIN = ("text-encoder", "dit", "vae", "interp")
CONDITIONING = (
    TensorSlot("prompt_embeds", "embeds", "always"),
    TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
)
_COMPUTE: dict[str, Any] = {  # Family's "module:attr" parts, passed as keywords
    "checkpoint_reader": "families.wan.checkpoint:read_geometry",
    "text_encoder": "families.wan.encode:WanPromptEncoder",
    "denoiser": "families.wan.denoise:WanDenoiser",
    "decoder": "families.wan.decode:WanStreamingDecoder",
    "writer": "families.wan.init_model:write_checkpoint",
}

_TEACACHE_REFERENCE = "tests/integration/test_step_cache.py::test_teacache_follows_the_reference_algorithm"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/), by family.
_T2V_CLASSES = "tests/integration/test_family_features.py::TestWanT2V"
_LORA = "tests/integration/test_lora.py::"
_WAN_TESTS = {
    "ulysses": (
        _T2V_CLASSES + "ParallelLayouts",
        "tests/e2e/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "ring": (_T2V_CLASSES + "ParallelLayouts",),
    "cfg_parallel": (_T2V_CLASSES + "ParallelLayouts",),
    "tensor_parallel": (
        _T2V_CLASSES + "ParallelLayouts",
        "tests/integration/test_tensor_parallel_hsdp.py::test_tensor_parallel_2_matches_single_rank",
    ),
    "hsdp": (
        _T2V_CLASSES + "ParallelLayouts",
        "tests/integration/test_tensor_parallel_hsdp.py::test_hsdp_shard_2_matches_single_rank_and_halves_parameters",
        "tests/e2e/test_e2e_parallel.py::test_parallel_dit_frames_equal_wan_pipeline",
    ),
    "vae_patch_parallel": (
        "tests/integration/test_vae_patch_parallel.py::test_patch_parallel_equals_untiled_decode",
        "tests/e2e/test_e2e_parallel.py::test_patch_parallel_vae_frames_equal_wan_pipeline",
    ),
    "vae_tiling": (
        "tests/integration/test_vae_patch_parallel.py::test_tiled_session_equals_diffusers_tiled_decode",
        "tests/e2e/test_e2e_vae_interp.py::test_tiled_vae_is_close_but_approximate",
    ),
    "interpolation": (
        "tests/e2e/test_e2e_parity.py::test_interpolation_keeps_originals_in_place",
        "tests/e2e/test_e2e_vae_interp.py::test_learned_interpolator_through_the_cluster",
    ),
    "cpu_offload": (
        _T2V_CLASSES + "ModuleOffload",
        "tests/unit/test_offload.py::test_transformer_output_unchanged",
        "tests/unit/test_offload.py::test_offload_of_a_quantized_transformer",
    ),
    "layerwise_offload": (
        _T2V_CLASSES + "LayerwiseOffload",
        "tests/unit/test_offload.py::test_layerwise_keeps_at_most_n_blocks_resident",
        "tests/unit/test_offload.py::test_transformer_output_unchanged",
        "tests/e2e/test_e2e_memory.py::test_offloaded_int8_dit_serves_close_frames",
    ),
    "fp8": (
        _T2V_CLASSES + "Quantization",
        "tests/unit/test_quantization.py::test_parameter_bytes_at_most_55_percent_of_bf16",
        "tests/unit/test_quantization.py::test_quantized_forward_close_to_unquantized",
    ),
    "int8": (
        _T2V_CLASSES + "Quantization",
        "tests/unit/test_quantization.py::test_parameter_bytes_at_most_55_percent_of_bf16",
        "tests/e2e/test_e2e_memory.py::test_offloaded_int8_dit_serves_close_frames",
    ),
    "gguf": (
        _T2V_CLASSES + "GGUF",
        "tests/integration/test_gguf.py::test_gguf_under_parallel_layouts_equals_one_rank",
        "tests/e2e/test_e2e_memory.py::test_gguf_dit_serves_frames_equal_to_wan_pipeline",
    ),
    "multithread_loading": (
        _T2V_CLASSES + "Loading",
        "tests/unit/test_weights.py::test_matches_from_pretrained",
        "tests/e2e/test_e2e_parity.py::test_cluster_frames_equal_wan_pipeline",
    ),
    "compile": (
        _T2V_CLASSES + "Compile",
        "tests/integration/test_compile.py::test_compiled_blocks_equal_eager_under_ulysses_and_hsdp",
    ),
    "first_block_cache": (
        _T2V_CLASSES + "StepCache",
        "tests/e2e/test_e2e_step_cache.py::test_first_block_cache_equals_pipeline_with_diffusers_cache",
    ),
    "mag_cache": (
        _T2V_CLASSES + "StepCache",
        "tests/integration/test_calibrate_cache_processes.py::test_calibrated_ratios_make_the_dit_offer_mag",
    ),
    "teacache": (
        _T2V_CLASSES + "StepCache",
        _TEACACHE_REFERENCE,
        "tests/e2e/test_e2e_step_cache.py::test_teacache_skips_passes_and_the_model_lists_its_caches",
    ),
    "batching": (
        _T2V_CLASSES + "Batching",
        "tests/integration/test_batching.py::test_batches_under_parallel_layouts_equal_one_rank_alone",
        "tests/e2e/test_e2e_batching.py::test_concurrent_requests_of_two_tenants_share_a_batch_and_keep_their_frames",
        "tests/e2e/test_e2e_batching.py::test_cancelling_one_request_of_a_batch_stops_only_it",
    ),
    "lora": (
        _T2V_CLASSES + "LoRA",
        _LORA + "test_adapters_under_parallel_layouts_equal_one_rank",
        "tests/e2e/test_e2e_lora.py::test_cluster_adapters_equal_diffusers_frames",
        "tests/e2e/test_demo_model_cluster.py::test_demo_adapter_swaps_a_colour_for_its_tenant_only",
    ),
    "step_scheduling": (_T2V_CLASSES + "StepScheduling",),
    "lora_fused": (
        _LORA + "test_fused_adapter_equals_the_adapter_per_request",
        "tests/e2e/test_e2e_lora.py::test_fused_adapter_is_served_as_its_own_model",
    ),
}
# Each expert keeps its own cache state, so the cache resets at the switch (the second expert's first step runs).
_TWO_EXPERTS_CACHE = ("tests/integration/test_family_features.py::TestWanA14BStepCache", _TEACACHE_REFERENCE)
# diffusers loads an adapter into the first expert only unless told otherwise (load_into_transformer_2).
_A14B_LORA = Support(
    reason="not verified yet with two experts (diffusers loads an adapter into the first unless told otherwise)",
    refusal_tests=LORA_UNVERIFIED.refusal_tests,
)
_A14B = "tests/integration/test_family_a14b_features.py::"
# A14B's test classes of its tester config and a feature mixin.
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestWanA14B"

WAN_T2V = Family(
    name="wan-t2v",
    pipeline="WanPipeline",
    description="Wan2.1 text-to-video (UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan)",
    class_name="WanPipeline",
    requires=(),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=CONDITIONING,
    defaults=RequestDefaults(),
    features={name: Support(tests=tests) for name, tests in _WAN_TESTS.items()},
    # A Wan2.1-layout model trained on the shape world (shapeworld/demo_model.py): it draws what its prompts say.
    trained_presets={"demo": "shapeworld:checkpoint"},
    own_presets={
        "wan2.1-1.3b-config": "Wan2.1-T2V-1.3B-Diffusers' configs and shard layout (about 7B parameters) "
        "with random bf16 weights"
    },
    gguf_names="families.wan.gguf_names:original_name",
    gguf_arch="wan",
    **_COMPUTE,
)

WAN22_A14B = Family(
    name="wan2.2-a14b",
    pipeline="WanPipeline (transformer_2, boundary_ratio)",
    description="Wan2.2 A14B text-to-video: two expert transformers switched at a boundary timestep",
    class_name="WanPipeline",
    requires=("transformer_2", "boundary_ratio"),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=CONDITIONING,
    defaults=RequestDefaults(),
    features={
        "ulysses": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "ring": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "cfg_parallel": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "tensor_parallel": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "hsdp": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "vae_patch_parallel": Support(tests=(_A14B + "test_a14b_patch_parallel_vae_equals_whole_decode",)),
        # The same AutoencoderKLWan as Wan2.1, decoded by the same session.
        "vae_tiling": Support(tests=_WAN_TESTS["vae_tiling"]),
        "cpu_offload": Support(
            tests=(
                "tests/unit/test_offload.py::test_module_offload_keeps_one_expert_resident",
                _FEATURE_CLASSES + "ModuleOffload",
            )
        ),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "int8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "gguf": Support(tests=(_FEATURE_CLASSES + "GGUF",)),
        "multithread_loading": Support(
            tests=(
                _FEATURE_CLASSES + "Loading",
                "tests/e2e/test_families_cluster.py::test_a14b_cluster_equals_wan_pipeline",
            )
        ),
        "interpolation": Support(tests=(_A14B + "test_a14b_interpolation_keeps_decoded_frames_in_place",)),
        "compile": Support(
            reason="not verified yet with two experts",
            refusal_tests=("tests/integration/test_compile.py::test_compile_is_refused_at_startup_where_unverified",),
        ),
        "first_block_cache": Support(tests=_TWO_EXPERTS_CACHE),
        "mag_cache": Support(
            reason="MagCache's calibrated ratios index the steps of one schedule; each expert runs only part of it"
        ),
        "teacache": Support(tests=_TWO_EXPERTS_CACHE),
        "batching": Support(tests=(_FEATURE_CLASSES + "Batching",)),
        "step_scheduling": Support(tests=(_FEATURE_CLASSES + "StepScheduling",)),
        "lora": _A14B_LORA,
        "lora_fused": _A14B_LORA,
    },
    gguf_names="families.wan.gguf_names:original_name",
    gguf_arch="wan",
    **_COMPUTE,
)

FAMILIES = (WAN_T2V, WAN22_A14B)
