"""HunyuanVideo 1.5 text-to-video and image-to-video: Qwen2.5-VL and ByT5 text encoders (and SigLIP for the image),
HunyuanVideo15Transformer3DModel (8.3B), AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal, causal in time).

Declarations only (no torch); the compute is beside this file: encode.py (both text encoders in one stage),
denoise.py (the loop with the checkpoint's guider), parallel.py (the parallel plan), decode.py (the streaming causal
VAE decode), checkpoint.py and init_model.py. The request's guidance_scale is the guider's scale (its default the
checkpoint's guider config); above 1 both branches run, as ClassifierFreeGuidance decides.
"""

from __future__ import annotations

from families.base import LORA_UNVERIFIED, Family, ImageInputs, RequestDefaults, SizeFromImage, Support, TensorSlot

CHAIN = ("text-encoder", "dit", "vae", "interp")
# Each text has its own length, padded to the request's longest with a mask; ByT5's glyph embedding has its own
# width, and a prompt without quoted text has none (one masked row).
CONDITIONING = (
    TensorSlot("prompt_embeds", "embeds", "always"),
    TensorSlot("prompt_embeds_mask", "mask", "optional", of="prompt_embeds"),
    TensorSlot("prompt_glyph_embeds", "embeds", "always", width="glyph_dim"),
    TensorSlot("prompt_glyph_embeds_mask", "mask", "optional", of="prompt_glyph_embeds", may_be_empty=True),
    TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
    TensorSlot("negative_prompt_embeds_mask", "mask", "optional", of="negative_prompt_embeds"),
    TensorSlot("negative_prompt_glyph_embeds", "embeds", "cfg", width="glyph_dim"),
    TensorSlot(
        "negative_prompt_glyph_embeds_mask", "mask", "optional", of="negative_prompt_glyph_embeds", may_be_empty=True
    ),
)
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestHunyuanVideo15"
_PARALLEL = (_FEATURE_CLASSES + "ParallelLayouts",)
_E2E = "tests/e2e/test_video_families_cluster.py::"
_DECODE = "tests/integration/test_hunyuanvideo_15_decode.py::"
# diffusers' cache hooks wrap only the blocks its hooks/_helpers.py registers, and 0.42.1 registers no
# HunyuanVideo15TransformerBlock: the pipeline cannot run them, so there is no reference to check a cache against.
_NO_REFERENCE_CACHE = Support(
    reason="diffusers 0.42.1's cache hooks have no metadata for HunyuanVideo15TransformerBlock, so the pipeline "
    "cannot run them as the reference"
)
# HunyuanVideo15Pipeline has no LoRA loader (no load_lora_weights in diffusers 0.42.1): nothing to check against.
_NO_LORA_LOADER = Support(
    reason="HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42.1 to check adapters against",
    refusal_tests=LORA_UNVERIFIED.refusal_tests,
)


def _features(classes: str, e2e: str) -> dict[str, Support]:
    """`classes`: the prefix of the family's tester config's feature classes; `e2e`: its cluster test."""
    parallel = (classes + "ParallelLayouts",)
    return {
        "ulysses": Support(tests=parallel),
        "ring": Support(tests=parallel),
        "cfg_parallel": Support(tests=parallel),
        "tensor_parallel": Support(tests=parallel),
        "hsdp": Support(tests=parallel),
        "vae_patch_parallel": Support(
            tests=(_DECODE + "test_patch_parallel_streamed_decode_equals_single_device", _E2E + e2e)
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; this VAE decodes each frame whole"
        ),
        "cpu_offload": Support(tests=(classes + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(classes + "LayerwiseOffload",)),
        "fp8": Support(tests=(classes + "Quantization",)),
        "int8": Support(tests=(classes + "Quantization",)),
        "gguf": Support(reason="no GGUF tensor names are mapped for HunyuanVideo15Transformer3DModel yet"),
        "multithread_loading": Support(tests=(classes + "Loading", _E2E + e2e)),
        "compile": Support(tests=(classes + "Compile",)),
        "interpolation": Support(tests=(_E2E + e2e,)),
        "first_block_cache": _NO_REFERENCE_CACHE,
        "mag_cache": _NO_REFERENCE_CACHE,
        "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
        "batching": Support(reason="not built yet: one request at a time"),
        "lora": _NO_LORA_LOADER,
        "lora_fused": _NO_LORA_LOADER,
    }


HUNYUANVIDEO_15 = Family(
    name="hunyuanvideo-1.5",
    pipeline="HunyuanVideo15Pipeline",
    description="HunyuanVideo 1.5 text-to-video (Qwen2.5-VL and ByT5 text encoders, "
    "HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15); guidance_scale is the guider's CFG scale",
    class_name="HunyuanVideo15Pipeline",
    requires=(),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=CONDITIONING,
    # HunyuanVideo15Pipeline's 480p defaults; the checkpoint's target size and guider decide (checkpoint.py).
    defaults=RequestDefaults(
        height=480, width=848, num_frames=121, num_inference_steps=50, guidance_scale=6.0, fps=24.0
    ),
    checkpoint_reader="families.hunyuanvideo_15.checkpoint:read_geometry",
    text_encoder="families.hunyuanvideo_15.encode:HunyuanVideo15PromptEncoder",
    denoiser="families.hunyuanvideo_15.denoise:HunyuanVideo15Denoiser",
    decoder="families.hunyuanvideo_15.decode:HunyuanVideo15StreamingDecoder",
    writer="families.hunyuanvideo_15.init_model:write_checkpoint",
    own_presets={
        "hunyuanvideo-1.5-480p-config": "HunyuanVideo-1.5-Diffusers-480p_t2v's published configs (8.3B transformer, "
        "Qwen2.5-VL-7B, Glyph ByT5), random bf16 weights",
    },
    features=_features(_FEATURE_CLASSES, "test_hunyuanvideo_15_cluster_equals_pipeline"),
)

HUNYUANVIDEO_15_I2V = Family(
    name="hunyuanvideo-1.5-i2v",
    pipeline="HunyuanVideo15ImageToVideoPipeline",
    description="HunyuanVideo 1.5 image-to-video: the first frame's latents beside the noise and its SigLIP "
    "embedding beside the texts; the output size is the crop bucket of the model's target size nearest the "
    "image's aspect ratio, as the pipeline makes it (it takes no other)",
    class_name="HunyuanVideo15ImageToVideoPipeline",
    requires=(),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=(
        *CONDITIONING,
        TensorSlot("image_embeds", "embeds", "always", image=True),
        TensorSlot("image_latents", "latents", "always", source="vae", image=True),
    ),
    defaults=RequestDefaults(
        height=480, width=848, num_frames=121, num_inference_steps=50, guidance_scale=6.0, fps=24.0
    ),
    images=ImageInputs(
        roles=("first_frame",),
        required=("first_frame",),
        encoded_by=("text-encoder", "vae"),
        size_from=SizeFromImage(area=0, multiple=0, buckets=True, fixed=True),
    ),
    checkpoint_reader="families.hunyuanvideo_15.checkpoint:read_image_to_video_geometry",
    text_encoder="families.hunyuanvideo_15.encode:HunyuanVideo15ImageConditionEncoder",
    image_encoder="families.hunyuanvideo_15.vae_encode:HunyuanVideo15ImageLatentEncoder",
    denoiser="families.hunyuanvideo_15.denoise:HunyuanVideo15Denoiser",
    decoder="families.hunyuanvideo_15.decode:HunyuanVideo15StreamingDecoder",
    writer="families.hunyuanvideo_15.init_model:write_checkpoint",
    own_presets={
        "hunyuanvideo-1.5-480p-i2v-config": "HunyuanVideo-1.5-Diffusers-480p_i2v's published configs (8.3B "
        "transformer, Qwen2.5-VL-7B, Glyph ByT5, SigLIP so400m), random bf16 weights",
    },
    features=_features(_FEATURE_CLASSES + "I2V", "test_hunyuanvideo_15_i2v_cluster_equals_pipeline"),
)

FAMILIES = (HUNYUANVIDEO_15, HUNYUANVIDEO_15_I2V)
