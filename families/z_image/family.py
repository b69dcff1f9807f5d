"""Z-Image text-to-image (Z-Image and Z-Image-Turbo): Qwen3 text encoder, ZImageTransformer2DModel, AutoencoderKL.

Declarations only (no torch); the compute is beside this file: encode.py, denoise.py, parallel.py (Ulysses, Ring
and HSDP of the single-stream DiT), checkpoint.py and init_model.py. The VAE stage is FLUX.1's decoder
(families/flux/decode.py): ZImagePipeline decodes exactly as FluxPipeline does, with the same AutoencoderKL and
its scale and shift. The two published checkpoints are one family: they share ZImagePipeline and every config
but the scheduler's shift (checkpoint.py chooses the defaults from it).

The request's guidance_scale is ZImagePipeline's: it steers with `positive + scale * (positive - negative)`, so
any scale above 0 runs CFG with the negative prompt (the family's `cfg_threshold` is 0, where most families' is 1).
"""

from __future__ import annotations

from families.base import Family, RequestDefaults, Support, TensorSlot

_KL_PATCH_PARALLEL = "tests/integration/test_autoencoder_kl_patch_parallel.py::"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestZImage"
_LORA = "tests/integration/test_lora.py::"
_LATENTS_PARALLEL = _FEATURE_CLASSES + "ParallelLayouts"
Z_IMAGE = Family(
    name="z-image",
    pipeline="ZImagePipeline",
    description="Z-Image and Z-Image-Turbo text-to-image (Qwen3 text encoder, single-stream "
    "ZImageTransformer2DModel, AutoencoderKL); the request's guidance_scale is ZImagePipeline's: any scale above "
    "0 runs CFG with the negative prompt",
    class_name="ZImagePipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    # Each text has its own length (the chat-templated prompt's tokens): padded to the longest with a mask.
    conditioning=(
        TensorSlot("prompt_embeds", "embeds", "always"),
        TensorSlot("prompt_embeds_mask", "mask", "optional", of="prompt_embeds"),
        TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
        TensorSlot("negative_prompt_embeds_mask", "mask", "optional", of="negative_prompt_embeds"),
    ),
    # ZImagePipeline's defaults (Z-Image); Z-Image-Turbo's come from its checkpoint (checkpoint.py).
    defaults=RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=5.0),
    checkpoint_reader="families.z_image.checkpoint:read_geometry",
    text_encoder="families.z_image.encode:ZImagePromptEncoder",
    denoiser="families.z_image.denoise:ZImageDenoiser",
    decoder="families.flux.decode:FluxDecoder",
    writer="families.z_image.init_model:write_checkpoint",
    cfg_threshold=0.0,
    own_presets={
        "tiny-turbo": "Z-Image-Turbo's kind at the tiny size: its scheduler's shift, 8 steps, no CFG",
        "z-image-turbo-config": "Z-Image-Turbo's published configs (6B transformer, Qwen3-4B), random bf16 weights",
    },
    features={
        "ulysses": Support(tests=(_LATENTS_PARALLEL,)),
        "ring": Support(tests=(_LATENTS_PARALLEL,)),
        "cfg_parallel": Support(tests=(_LATENTS_PARALLEL,)),
        "tensor_parallel": Support(tests=(_LATENTS_PARALLEL,)),
        "hsdp": Support(tests=(_LATENTS_PARALLEL,)),
        "vae_patch_parallel": Support(
            tests=(
                _KL_PATCH_PARALLEL + "test_kl_patch_parallel_equals_whole_decode",
                _KL_PATCH_PARALLEL + "test_kl_vae_decode_check_accepts_patch_parallel",
            )
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; AutoencoderKL decodes each image whole"
        ),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "int8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "multithread_loading": Support(tests=(_FEATURE_CLASSES + "Loading",)),
        "compile": Support(tests=(_FEATURE_CLASSES + "Compile",)),
        "interpolation": Support(
            reason="single images: nothing to interpolate; a request asking for it is refused with INVALID_ARGUMENT"
        ),
        "first_block_cache": Support(
            reason="diffusers' FirstBlockCache hook reads each block's `hidden_states` argument, which "
            "ZImageTransformerBlock names `x` (diffusers 0.42.1), so the reference the cache is checked against "
            "fails on this model"
        ),
        "gguf": Support(reason="no GGUF tensor names are mapped for ZImageTransformer2DModel yet"),
        "mag_cache": Support(reason="as for the first-block cache: diffusers' MagCache hook reads `hidden_states`"),
        "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
        "batching": Support(
            tests=(
                _FEATURE_CLASSES + "Batching",
                "tests/integration/test_batching.py::test_batches_under_parallel_layouts_equal_one_rank_alone",
            )
        ),
        # diffusers' format through ZImagePipeline's loader (which also converts the community formats it knows).
        "lora": Support(
            tests=(_FEATURE_CLASSES + "LoRA", _LORA + "test_adapters_under_parallel_layouts_equal_one_rank")
        ),
        "lora_fused": Support(tests=(_FEATURE_CLASSES + "LoRA",)),
    },
)

FAMILIES = (Z_IMAGE,)
