"""FLUX.1 text-to-image (FLUX.1-dev and FLUX.1-schnell): CLIP + T5 text encoders, FluxTransformer2DModel, AutoencoderKL.

Declarations only (no torch); the compute is beside this file: encode.py, denoise.py, parallel.py (Ulysses, Ring
and HSDP of the double- and single-stream DiT), decode.py, checkpoint.py and init_model.py. The two published
checkpoints are one family: they share FluxPipeline and every config key but the transformer's `guidance_embeds`
(checkpoint.py chooses the defaults from it).
"""

from __future__ import annotations

from families.base import Family, RequestDefaults, Support, TensorSlot

_KL_PATCH_PARALLEL = "tests/integration/test_autoencoder_kl_patch_parallel.py::"
_FLUX = "tests/integration/test_family_flux.py::"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestFlux"
_CLUSTER = "tests/e2e/test_image_families_cluster.py::test_flux_cluster_equals_pipeline"
_LATENTS_PARALLEL = _FEATURE_CLASSES + "ParallelLayouts"
_QUANTIZATION = (_FEATURE_CLASSES + "Quantization",)
_LORA = "tests/integration/test_lora.py::"
_COMMUNITY_LORA = "tests/integration/test_lora_flux.py::"

FLUX = Family(
    name="flux",
    pipeline="FluxPipeline",
    description="FLUX.1-dev and FLUX.1-schnell text-to-image (CLIP and T5 text encoders, FluxTransformer2DModel, "
    "AutoencoderKL); the request's guidance_scale is FluxPipeline's true_cfg_scale, its embedded_guidance_scale "
    "the pipeline's guidance_scale (FLUX.1-dev's guidance embedding)",
    class_name="FluxPipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    # Each text: T5's sequence (max_sequence_length rows, padding attended as FluxPipeline does) and CLIP's
    # pooled vector.
    conditioning=(
        TensorSlot("prompt_embeds", "embeds", "always"),
        TensorSlot("prompt_pooled_embeds", "pooled", "always"),
        TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
        TensorSlot("negative_prompt_pooled_embeds", "pooled", "cfg"),
    ),
    # FLUX.1-dev's; FLUX.1-schnell's come from its checkpoint (checkpoint.py).
    defaults=RequestDefaults(
        height=1024, width=1024, num_frames=1, num_inference_steps=28, guidance_scale=1.0, embedded_guidance_scale=3.5
    ),
    checkpoint_reader="families.flux.checkpoint:read_geometry",
    text_encoder="families.flux.encode:FluxPromptEncoder",
    denoiser="families.flux.denoise:FluxBatchDenoiser",
    lora_loader="families.flux.lora:FluxLoraLoader",
    decoder="families.flux.decode:FluxDecoder",
    writer="families.flux.init_model:write_checkpoint",
    own_presets={
        "tiny-schnell": "FLUX.1-schnell's kind at the tiny size: no guidance embedding, a fixed shift",
        "flux.1-dev-config": "FLUX.1-dev's published configs (12B transformer, T5-XXL, CLIP-L), random bf16 weights",
        "flux.1-schnell-config": "FLUX.1-schnell's published configs, random bf16 weights",
    },
    features={
        "ulysses": Support(tests=(_LATENTS_PARALLEL, _CLUSTER)),
        "ring": Support(tests=(_LATENTS_PARALLEL,)),
        "cfg_parallel": Support(tests=(_LATENTS_PARALLEL,)),
        "tensor_parallel": Support(tests=(_LATENTS_PARALLEL,)),
        "hsdp": Support(tests=(_LATENTS_PARALLEL,)),
        "vae_patch_parallel": Support(
            tests=(
                _KL_PATCH_PARALLEL + "test_kl_patch_parallel_equals_whole_decode",
                _KL_PATCH_PARALLEL + "test_kl_vae_decode_check_accepts_patch_parallel",
                _CLUSTER,
            )
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; AutoencoderKL decodes each image whole"
        ),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=_QUANTIZATION),
        "int8": Support(tests=_QUANTIZATION),
        "gguf": Support(
            reason="not verified: published FLUX.1 GGUF files keep BFL's names with fused tensors (qkv, single "
            "blocks' linear1), which diffusers' convert_flux_transformer_checkpoint_to_diffusers splits at FLUX.1's "
            "own width (3072), so no small checkpoint loads, and a 3072-wide one outgrows the test budget"
        ),
        "multithread_loading": Support(tests=(_FEATURE_CLASSES + "Loading",)),
        "compile": Support(tests=(_FEATURE_CLASSES + "Compile",)),
        "interpolation": Support(
            reason="single images: nothing to interpolate; a request asking for it is refused with INVALID_ARGUMENT"
        ),
        "first_block_cache": Support(tests=(_FEATURE_CLASSES + "StepCache",)),
        "mag_cache": Support(tests=(_FEATURE_CLASSES + "StepCache",)),
        "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
        "batching": Support(
            tests=(
                _FEATURE_CLASSES + "Batching",
                "tests/integration/test_batching.py::test_batches_under_parallel_layouts_equal_one_rank_alone",
            )
        ),
        # diffusers' format, the community formats FluxPipeline's loader converts (kohya, ComfyUI, XLabs) and BFL's
        # lora_A/lora_B names, which the family's loader reads (families/flux/lora.py).
        "lora": Support(
            tests=(
                _FEATURE_CLASSES + "LoRA",
                _LORA + "test_adapters_under_parallel_layouts_equal_one_rank",
                _COMMUNITY_LORA + "test_community_flux_adapters_equal_diffusers_conversion",
                "tests/e2e/test_image_families_cluster.py::test_a_community_flux_lora_through_the_cluster_equals_diffusers",
            )
        ),
        "lora_fused": Support(tests=(_COMMUNITY_LORA + "test_a_fused_community_flux_adapter_equals_it_per_request",)),
    },
)

FAMILIES = (FLUX,)
