"""Wan image-to-video: Wan2.1 I2V (`wan-i2v`, CLIP image embedding and first frame), Wan2.2 I2V A14B (two
experts, no CLIP) and Wan2.2 TI2V-5B (the Wan2.2 VAE, text-to-video and image-to-video from one checkpoint).

All three run WanImageToVideoPipeline's loop (TI2V without an image runs WanPipeline's), one denoiser for
the three (denoise.py): the VAE-encoded input frames condition every step, concatenated to the latents
with a mask of the given frames (Wan2.1 and A14B), or written over the first latent frame with a
per-token timestep (TI2V, `expand_timesteps`). Declarations only (no torch); the compute is beside this
file, and what is Wan's own (the prompt encoder, the parallel plan, the streaming decoder) is reused from
families/wan.
"""

from __future__ import annotations

from typing import Any

from families.base import LORA_UNVERIFIED, Family, ImageInputs, RequestDefaults, Support, TensorSlot

CHAIN = ("text-encoder", "dit", "vae", "interp")
_TEXT = (
    TensorSlot("prompt_embeds", "embeds", "always"),
    TensorSlot("negative_prompt_embeds", "embeds", "cfg"),
)
_COMPUTE: dict[str, Any] = {  # Family's "module:attr" parts, passed as keywords
    "checkpoint_reader": "families.wan_i2v.checkpoint:read_geometry",
    "denoiser": "families.wan_i2v.denoise:WanImageToVideoDenoiser",
    "decoder": "families.wan.decode:WanStreamingDecoder",
    "writer": "families.wan_i2v.init_model:write_checkpoint",
    "image_encoder": "families.wan_i2v.vae_encode:WanImageLatentEncoder",
}
_E2E = "tests/e2e/test_e2e_image_to_video.py::"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/), by family.
_FEATURE_CLASSES = "tests/integration/test_family_features.py::Test"
# The decode is Wan's session on the same VAE, but the VAE's Encode of the input frames runs untiled, and no
# test compares tiled image-to-video with the pipeline's: the stage refuses the flag rather than serve it unproven.
# The caches hook the same WanTransformer3DModel blocks as text-to-video, but no test has compared them with
# WanImageToVideoPipeline yet (its image-conditioned inputs, the TI2V per-token timestep, two experts).
_UNVERIFIED_CACHE = Support(reason="not verified yet against WanImageToVideoPipeline")
_UNVERIFIED_TILING = Support(
    reason="not yet verified with image-to-video (the Encode of the input frames would run untiled)",
    refusal_tests=("tests/integration/test_image_families_options.py::test_vae_tiling_is_refused_at_startup",),
)


# The patch-parallel VAE of an image-to-video cluster: its decode in bands over two ranks (the Wan2.1 and the
# Wan2.2 VAE), its Encode whole on rank 0, through the A14B cluster test.
_VAE_PATCH_PARALLEL = Support(
    tests=(
        "tests/integration/test_vae_patch_parallel.py::test_patch_parallel_equals_untiled_decode",
        "tests/e2e/test_e2e_models.py::test_i2v_equals_its_pipeline_on_the_shared_text_encoder_and_vae",
    )
)


def _features(e2e: str, tester: str, **more: Support) -> dict[str, Support]:
    """`e2e`: the family's cluster test (its DiT on one rank: the layouts are proven on the latents); `tester`: the
    name its tester config gives its feature classes."""
    classes = _FEATURE_CLASSES + tester
    parallel = classes + "ParallelLayouts"
    return {
        "ulysses": Support(tests=(parallel,)),
        "ring": Support(tests=(parallel,)),
        "cfg_parallel": Support(tests=(parallel,)),
        "tensor_parallel": Support(tests=(parallel,)),
        "hsdp": Support(tests=(parallel,)),
        "vae_patch_parallel": _VAE_PATCH_PARALLEL,
        "vae_tiling": _UNVERIFIED_TILING,
        "cpu_offload": Support(tests=(classes + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(classes + "LayerwiseOffload",)),
        "fp8": Support(tests=(classes + "Quantization",)),
        "int8": Support(tests=(classes + "Quantization",)),
        "multithread_loading": Support(tests=(classes + "Loading", e2e)),
        "compile": Support(
            reason="not verified yet with image conditioning",
            refusal_tests=("tests/integration/test_compile.py::test_compile_is_refused_at_startup_where_unverified",),
        ),
        "interpolation": Support(tests=(_E2E + "test_wan_i2v_interpolation_keeps_decoded_frames_in_place",)),
        "first_block_cache": _UNVERIFIED_CACHE,
        "mag_cache": _UNVERIFIED_CACHE,
        "teacache": _UNVERIFIED_CACHE,
        "batching": Support(
            reason="not built yet: the image-conditioned loop (image latents, TI2V's per-token timestep) runs one "
            "request at a time"
        ),
        "lora": LORA_UNVERIFIED,
        "lora_fused": LORA_UNVERIFIED,
        **more,
    }


WAN_I2V = Family(
    name="wan-i2v",
    pipeline="WanImageToVideoPipeline",
    description=(
        "Wan2.1 image-to-video (UMT5 text encoder, CLIP vision image encoder, WanTransformer3DModel with "
        "image cross-attention, AutoencoderKLWan); first-last-frame-to-video where the checkpoint takes it"
    ),
    class_name="WanImageToVideoPipeline",
    requires=("image_encoder",),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=(
        *_TEXT,
        TensorSlot("image_embeds", "embeds", "always", image=True),
        TensorSlot("image_latents", "latents", "always", source="vae", image=True),
    ),
    defaults=RequestDefaults(),
    text_encoder="families.wan_i2v.encode:WanImageConditionEncoder",
    images=ImageInputs(
        roles=("first_frame", "last_frame"), required=("first_frame",), encoded_by=("text-encoder", "vae")
    ),
    features=_features(_E2E + "test_wan_i2v_frames_equal_pipeline", "WanI2V"),
    **_COMPUTE,
)

WAN22_I2V_A14B = Family(
    name="wan2.2-i2v-a14b",
    pipeline="WanImageToVideoPipeline (transformer_2, boundary_ratio)",
    description="Wan2.2 I2V A14B: two expert transformers switched at a boundary timestep, no CLIP encoder",
    class_name="WanImageToVideoPipeline",
    requires=("transformer_2", "boundary_ratio"),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=(*_TEXT, TensorSlot("image_latents", "latents", "always", source="vae", image=True)),
    defaults=RequestDefaults(),
    text_encoder="families.wan.encode:WanPromptEncoder",
    images=ImageInputs(roles=("first_frame", "last_frame"), required=("first_frame",), encoded_by=("vae",)),
    features=_features(
        "tests/e2e/test_e2e_models.py::test_i2v_equals_its_pipeline_on_the_shared_text_encoder_and_vae", "WanI2VA14B"
    ),
    **_COMPUTE,
)

WAN22_TI2V = Family(
    name="wan2.2-ti2v",
    pipeline="WanPipeline / WanImageToVideoPipeline (expand_timesteps)",
    description=(
        "Wan2.2 TI2V-5B: the Wan2.2 VAE (z_dim 48, 16x spatial compression) and per-token timesteps; "
        "text-to-video, or image-to-video when the request sends a first frame"
    ),
    class_name="WanPipeline",
    requires=("expand_timesteps",),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=(*_TEXT, TensorSlot("image_latents", "latents", "image", source="vae", image=True)),
    defaults=RequestDefaults(height=704, width=1280, num_frames=121, fps=24.0),
    text_encoder="families.wan.encode:WanPromptEncoder",
    images=ImageInputs(roles=("first_frame",), required=(), encoded_by=("vae",)),
    features=_features(_E2E + "test_wan22_ti2v_frames_equal_pipelines", "WanTI2V"),
    **_COMPUTE,
)

FAMILIES = (WAN_I2V, WAN22_I2V_A14B, WAN22_TI2V)
