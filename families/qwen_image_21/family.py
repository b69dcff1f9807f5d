"""Qwen-Image 2.1 text-to-image with true CFG (Qwen3-VL text encoder, single-stream block-causal
QwenImage21Transformer2DModel, AutoencoderKLQwenImage21, whose RGBA image is served as RGB: StageDiff's results are
RGB frames, so the VAE stage drops the alpha channel, as `.convert("RGB")` does).

Declarations only (no torch); the compute is beside this file: encode.py, denoise.py, decode.py, checkpoint.py and
init_model.py. What it shares with Qwen-Image (families/qwen_image/) is imported from there: the text
conditioning's padding and masks, the decode session, the tokenizer and the scheduler of the random checkpoints.
The transformer is not Qwen-Image's MMDiT with another config: one joint text+image stream with block-causal
attention and a KV cache of the text, so Qwen-Image's parallel plan does not apply to it.

The request's guidance_scale is QwenImage21Pipeline's true_cfg_scale (its default 1: no CFG). QwenImage21Pipeline
also takes condition images, which the text encoder reads in the prompt; this family serves text-to-image only.
"""

from __future__ import annotations

from families.base import LORA_UNVERIFIED, Family, RequestDefaults, Support, TensorSlot

# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/).
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestQwenImage21"
_SEQUENCE_PARALLEL = (
    "not built yet: the joint text+image sequence attends block-causally (each segment to the keys before it) and "
    "the text's keys and values are cached after the first step, which a sequence split would have to reproduce "
    "across ranks; Qwen-Image's plan splits the image stream of a two-stream MMDiT and does not apply; use "
    "CFG-parallel, tensor parallel or HSDP"
)

QWEN_IMAGE_21 = Family(
    name="qwen-image-2.1",
    pipeline="QwenImage21Pipeline",
    description="Qwen-Image 2.1 text-to-image with true CFG (Qwen3-VL text encoder, single-stream block-causal "
    "QwenImage21Transformer2DModel with a KV cache of the text, AutoencoderKLQwenImage21); the pipeline's RGBA "
    "image is served as RGB, its alpha dropped; condition images are not served yet",
    class_name="QwenImage21Pipeline",
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
    # QwenImage21Pipeline's defaults: output_resolution 1024, 40 steps, true_cfg_scale 1.
    defaults=RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=40, guidance_scale=1.0),
    checkpoint_reader="families.qwen_image_21.checkpoint:read_geometry",
    text_encoder="families.qwen_image_21.encode:Qwen21PromptEncoder",
    denoiser="families.qwen_image_21.denoise:QwenImage21Denoiser",
    decoder="families.qwen_image_21.decode:QwenImage21Decoder",
    writer="families.qwen_image_21.init_model:write_checkpoint",
    features={
        "cfg_parallel": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "ulysses": Support(reason=_SEQUENCE_PARALLEL),
        "ring": Support(reason=_SEQUENCE_PARALLEL),
        "tensor_parallel": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "hsdp": Support(tests=(_FEATURE_CLASSES + "ParallelLayouts",)),
        "vae_patch_parallel": Support(
            reason="not built yet: the patch-parallel decode is written for AutoencoderKLQwenImage's layers, and "
            "AutoencoderKLQwenImage21 has its own (residual up/down blocks, RGBA output); each image is decoded "
            "whole on one device"
        ),
        "vae_tiling": Support(
            reason="tiled decode is implemented for the Wan VAE only; AutoencoderKLQwenImage21 decodes each image "
            "whole on one device"
        ),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "int8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "gguf": Support(reason="no GGUF tensor names are mapped for QwenImage21Transformer2DModel"),
        "multithread_loading": Support(tests=(_FEATURE_CLASSES + "Loading",)),
        "compile": Support(
            reason="not checked yet: the prefill runs one attention call per text segment, whose count and shapes "
            "change with each prompt",
            refusal_tests=("tests/integration/test_compile.py::test_compile_is_refused_at_startup_where_unverified",),
        ),
        "interpolation": Support(
            reason="single images: nothing to interpolate; a request asking for it is refused with INVALID_ARGUMENT"
        ),
        "first_block_cache": Support(
            reason="not checked yet: the first step fills the text's KV cache, so a skipped step must still do that"
        ),
        "mag_cache": Support(reason="not checked yet: as for the first-block cache"),
        "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
        "batching": Support(reason="not built yet for Qwen-Image 2.1"),
        "lora": LORA_UNVERIFIED,
        "lora_fused": LORA_UNVERIFIED,
    },
)

FAMILIES = (QWEN_IMAGE_21,)
