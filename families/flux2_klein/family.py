"""FLUX.2 klein text-to-image (FLUX.2-klein, step-distilled, and FLUX.2-klein-base): a Qwen3 text encoder,
Flux2Transformer2DModel, AutoencoderKLFlux2.

Declarations only (no torch); the compute is beside this file: encode.py, denoise.py, parallel.py (Ulysses, Ring
and HSDP of the double- and single-stream DiT), decode.py, checkpoint.py and init_model.py. The published
checkpoints of both kinds are one family: they share Flux2KleinPipeline and every component config, and differ
only in model_index.json's `is_distilled`, which decides the guidance (checkpoint.py chooses the defaults from it,
denoise.py whether CFG runs).
"""

from __future__ import annotations

from families.base import Family, RequestDefaults, Support, TensorSlot

_KL_PATCH_PARALLEL = "tests/integration/test_autoencoder_kl_patch_parallel.py::"
_KLEIN = "tests/integration/test_family_flux2_klein.py::"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestFlux2Klein"
_LATENTS_PARALLEL = (_FEATURE_CLASSES + "ParallelLayouts",)
_QUANTIZATION = (_FEATURE_CLASSES + "Quantization",)
_STEP_CACHE = (_FEATURE_CLASSES + "StepCache",)
_REFUSED = (_KLEIN + "test_klein_stages_refuse_what_the_family_does_not_run",)

FLUX2_KLEIN = Family(
    name="flux2-klein",
    pipeline="Flux2KleinPipeline",
    description="FLUX.2 klein text-to-image, step-distilled and base (Qwen3 text encoder, Flux2Transformer2DModel, "
    "AutoencoderKLFlux2); the request's guidance_scale is the pipeline's guidance_scale, CFG with the negative "
    "prompt for the base model, ignored by the distilled one as the pipeline ignores it",
    class_name="Flux2KleinPipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    # Each text: the stacked Qwen3 hidden states of max_sequence_length tokens, padding included and attended as
    # Flux2KleinPipeline does (it sends no mask).
    conditioning=(
        TensorSlot("prompt_embeds", "embeds", "always"),
        TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
    ),
    # Flux2KleinPipeline's own defaults (both kinds); a checkpoint's kind chooses its own (checkpoint.py).
    defaults=RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=4.0),
    checkpoint_reader="families.flux2_klein.checkpoint:read_geometry",
    text_encoder="families.flux2_klein.encode:Flux2KleinPromptEncoder",
    denoiser="families.flux2_klein.denoise:Flux2KleinDenoiser",
    decoder="families.flux2_klein.decode:Flux2KleinDecoder",
    writer="families.flux2_klein.init_model:write_checkpoint",
    own_presets={
        "tiny-base": "FLUX.2-klein-base's kind at the tiny size: not distilled, CFG with a negative prompt",
        "flux2-klein-4b-config": "FLUX.2 [klein] 4B's published configs (4B transformer, Qwen3-4B), random bf16",
    },
    features={
        "ulysses": Support(tests=_LATENTS_PARALLEL),
        "ring": Support(tests=_LATENTS_PARALLEL),
        "cfg_parallel": Support(tests=_LATENTS_PARALLEL),
        "tensor_parallel": Support(tests=_LATENTS_PARALLEL),
        "hsdp": Support(tests=_LATENTS_PARALLEL),
        "vae_patch_parallel": Support(
            tests=(
                _KL_PATCH_PARALLEL + "test_kl_patch_parallel_equals_whole_decode",
                _KL_PATCH_PARALLEL + "test_kl_vae_decode_check_accepts_patch_parallel",
            )
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; AutoencoderKLFlux2 decodes each image whole",
            refusal_tests=_REFUSED,
        ),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=_QUANTIZATION),
        "int8": Support(tests=_QUANTIZATION),
        "gguf": Support(reason="no GGUF tensor names are mapped for Flux2Transformer2DModel yet"),
        "multithread_loading": Support(
            tests=(_FEATURE_CLASSES + "Loading", _KLEIN + "test_klein_stages_read_weights_with_their_load_threads")
        ),
        "compile": Support(tests=(_FEATURE_CLASSES + "Compile",)),
        "interpolation": Support(
            reason="single images: nothing to interpolate; a request asking for it is refused with INVALID_ARGUMENT"
        ),
        "first_block_cache": Support(
            reason="diffusers' FirstBlockCache cannot run Flux2Transformer2DModel: its tail hook subtracts the "
            "double-stream head's (text, image) pair from the single-stream tail's fused [text; image] output"
        ),
        "mag_cache": Support(tests=_STEP_CACHE),
        "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
        "batching": Support(reason="not built yet for FLUX.2 klein"),
        # diffusers' format through Flux2KleinPipeline's loader (Flux2LoraLoaderMixin, which also converts the
        # community formats it knows).
        "lora": Support(
            tests=(
                _FEATURE_CLASSES + "LoRA",
                "tests/integration/test_lora.py::test_adapters_under_parallel_layouts_equal_one_rank",
            )
        ),
        "lora_fused": Support(tests=(_FEATURE_CLASSES + "LoRA",)),
    },
)

FAMILIES = (FLUX2_KLEIN,)
