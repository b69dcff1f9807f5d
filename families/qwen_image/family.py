"""Qwen-Image text-to-image with true CFG (Qwen2.5-VL text encoder, QwenImageTransformer2DModel).

Declarations only (no torch); the compute is beside this file: encode.py, denoise.py, parallel.py (Ulysses,
Ring, tensor parallelism and HSDP of the joint text+image DiT), decode.py, checkpoint.py and init_model.py.
"""

from __future__ import annotations

from families.base import Family, RequestDefaults, Support, TensorSlot

_QWEN = "tests/integration/test_family_qwen_features.py::"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestQwenImage"
# The one parallel cluster: Ulysses, CFG-parallel and HSDP in the DiT, a patch-parallel VAE.
_CLUSTER_PARALLEL = "tests/e2e/test_families_cluster.py::test_qwen_parallel_dit_and_vae_equal_pipeline"
_LATENTS_PARALLEL = _FEATURE_CLASSES + "ParallelLayouts"
_PARALLEL = (
    _LATENTS_PARALLEL,
    "tests/unit/test_families.py::test_qwen_dit_layout_check_accepts_ring_tensor_and_hsdp",
)
_VAE_PATCH_PARALLEL = "tests/integration/test_qwen_vae_patch_parallel.py::"
_QUANTIZATION = (
    _FEATURE_CLASSES + "Quantization",
    _QWEN + "test_qwen_ignored_layers_are_checked_against_qwen_layer_names",
)

_STEP_CACHE = _FEATURE_CLASSES + "StepCache"
_LORA = "tests/integration/test_lora.py::"
QWEN_IMAGE = Family(
    name="qwen-image",
    pipeline="QwenImagePipeline",
    description="Qwen-Image text-to-image with true CFG (Qwen2.5-VL text encoder, QwenImageTransformer2DModel)",
    class_name="QwenImagePipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    # Each text has its own length: the text encoder pads to the longest and sends a mask per text.
    conditioning=(
        TensorSlot("prompt_embeds", "embeds", "always"),
        TensorSlot("prompt_embeds_mask", "mask", "optional", of="prompt_embeds"),
        TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
        TensorSlot("negative_prompt_embeds_mask", "mask", "optional", of="negative_prompt_embeds"),
    ),
    # QwenImagePipeline's defaults: 1024x1024, 50 steps, true_cfg_scale 4.
    defaults=RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=4.0),
    checkpoint_reader="families.qwen_image.checkpoint:read_geometry",
    text_encoder="families.qwen_image.encode:QwenPromptEncoder",
    denoiser="families.qwen_image.denoise:QwenImageDenoiser",
    decoder="families.qwen_image.decode:QwenImageDecoder",
    writer="families.qwen_image.init_model:write_checkpoint",
    features={
        "cfg_parallel": Support(tests=(_LATENTS_PARALLEL, _CLUSTER_PARALLEL)),
        "ulysses": Support(
            tests=(
                _LATENTS_PARALLEL,
                _CLUSTER_PARALLEL,
                "tests/integration/test_families_processes.py::test_qwen_ulysses_transformer_equals_one_rank",
            )
        ),
        "ring": Support(tests=_PARALLEL),
        "tensor_parallel": Support(tests=_PARALLEL),
        "hsdp": Support(tests=(*_PARALLEL, _CLUSTER_PARALLEL)),
        "vae_patch_parallel": Support(
            tests=(
                _VAE_PATCH_PARALLEL + "test_qwen_patch_parallel_equals_whole_decode",
                _VAE_PATCH_PARALLEL + "test_vae_rank_group_decodes_with_the_qwen_decoder",
                _VAE_PATCH_PARALLEL + "test_qwen_vae_decode_check_accepts_patch_parallel",
                _CLUSTER_PARALLEL,
            )
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; AutoencoderKLQwenImage decodes each image "
            "whole on one device",
            refusal_tests=("tests/integration/test_families_processes.py::test_qwen_vae_refuses_tiling_at_startup",),
        ),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=_QUANTIZATION),
        "int8": Support(tests=_QUANTIZATION),
        "multithread_loading": Support(
            tests=(
                _FEATURE_CLASSES + "Loading",
                _QWEN + "test_qwen_components_load_like_from_pretrained",
                _QWEN + "test_qwen_stages_read_weights_with_their_load_threads",
            )
        ),
        "compile": Support(tests=(_FEATURE_CLASSES + "Compile",)),
        "interpolation": Support(
            reason="single images: nothing to interpolate; a request asking for it is refused with INVALID_ARGUMENT"
        ),
        "first_block_cache": Support(tests=(_STEP_CACHE,)),
        "mag_cache": Support(tests=(_STEP_CACHE,)),
        "teacache": Support(
            reason="TeaCache's rescaling polynomials are published for Wan2.1 only; none is fitted to Qwen-Image"
        ),
        "step_scheduling": Support(tests=(_FEATURE_CLASSES + "StepScheduling",)),
        "batching": Support(
            reason="not built yet: each text has its own length and mask, which a batch would have to pad and "
            "check against QwenImagePipeline"
        ),
        "lora": Support(
            tests=(
                _FEATURE_CLASSES + "LoRA",
                _LORA + "test_adapters_under_parallel_layouts_equal_one_rank",
            )
        ),
        "lora_fused": Support(tests=(_LORA + "test_fused_adapter_equals_the_adapter_per_request",)),
    },
)

FAMILIES = (QWEN_IMAGE,)
