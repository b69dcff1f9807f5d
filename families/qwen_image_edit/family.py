"""Qwen-Image-Edit: editing one image with a prompt (QwenImageEditPipeline), and Qwen-Image-Edit-Plus, editing
from several reference images (QwenImageEditPlusPipeline, the Qwen-Image-Edit-2509 checkpoints).

Both are Qwen-Image (families/qwen_image) with the input images in two places: Qwen2.5-VL sees them inside
its prompt template (encode.py, on the text encoder), and their VAE latents (vae_encode.py, on the VAE's
Encode) follow the noise latents in the transformer's image sequence on every step (denoise.py). When a
request leaves height and width unset, the output takes the aspect ratio of the first image (Edit) or of
the last one (Edit-Plus) at about 1024x1024 pixels, as the pipelines' `calculate_dimensions` makes it; the
orchestrator fills the size in (`ImageInputs.size_from`), so the job records it. The transformer, the
scheduler, true CFG, the decoder and the parallel plan are Qwen-Image's, imported from there.

Declarations only (no torch).
"""

from __future__ import annotations

from typing import Any

from families.base import LORA_UNVERIFIED, Family, ImageInputs, RequestDefaults, SizeFromImage, Support, TensorSlot
from families.qwen_image.family import QWEN_IMAGE

# The pipelines' VAE image size: each input image, and the default output, at about this many pixels with
# the image's aspect ratio, each side a multiple of 32 (`calculate_dimensions(1024 * 1024, ...)`).
VAE_IMAGE_AREA = 1024 * 1024
IMAGE_SIDE_MULTIPLE = 32
# Qwen-Image-Edit-2509 is made for one to three input images.
PLUS_MAX_IMAGES = 3

_E2E = "tests/e2e/test_e2e_image_edit.py::"
_PLUS_E2E = _E2E + "test_qwen_image_edit_plus_images_equal_pipeline"
# Test classes of a tester config and a feature mixin (tests/helpers/feature_mixins/), by family.
_FEATURE_CLASSES = "tests/integration/test_family_features.py::Test"


def _features(e2e: str, parallel_e2e: str, tester: str) -> dict[str, Support]:
    """`parallel_e2e`: the family's cluster test with Ulysses, CFG-parallel and HSDP in the DiT and a
    patch-parallel VAE (whose Encode runs whole on rank 0, the decode in bands over both ranks); `tester`: the
    name its tester config gives its feature classes."""
    classes = _FEATURE_CLASSES + tester
    parallel = classes + "ParallelLayouts"
    return {
        "ulysses": Support(tests=(parallel, parallel_e2e)),
        "ring": Support(tests=(parallel,)),
        "cfg_parallel": Support(tests=(parallel, parallel_e2e)),
        "tensor_parallel": Support(tests=(parallel,)),
        "hsdp": Support(tests=(parallel, parallel_e2e)),
        "vae_patch_parallel": Support(tests=(parallel_e2e,)),
        # Qwen-Image's decoder, which has no tiled decode.
        "vae_tiling": Support(
            reason=QWEN_IMAGE.support("vae_tiling").reason,
            refusal_tests=("tests/integration/test_image_families_options.py::test_vae_tiling_is_refused_at_startup",),
        ),
        "cpu_offload": Support(tests=(classes + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(classes + "LayerwiseOffload",)),
        "fp8": Support(tests=(classes + "Quantization",)),
        "int8": Support(tests=(classes + "Quantization",)),
        "multithread_loading": Support(tests=(classes + "Loading", e2e)),
        # Qwen-Image's blocks, but with the input images' tokens in the sequence, which no test compiles yet.
        "compile": Support(
            reason="not verified yet with the input images' tokens",
            refusal_tests=("tests/integration/test_compile.py::test_compile_is_refused_at_startup_where_unverified",),
        ),
        "interpolation": QWEN_IMAGE.support("interpolation"),
        # Qwen-Image's blocks, but the edit pipelines' image tokens are not covered by a test yet.
        "first_block_cache": Support(reason="not verified yet against the edit pipelines"),
        "mag_cache": Support(reason="not verified yet against the edit pipelines"),
        "teacache": QWEN_IMAGE.support("teacache"),
        "batching": QWEN_IMAGE.support("batching"),
        "lora": LORA_UNVERIFIED,
        "lora_fused": LORA_UNVERIFIED,
    }


# Qwen-Image's: each text has its own length (a mask per text); then the input images' packed VAE latents.
CONDITIONING = (
    *QWEN_IMAGE.conditioning,
    TensorSlot("image_latents", "packed", "always", source="vae", image=True),
)
_COMPUTE: dict[str, Any] = {  # Family's "module:attr" parts, passed as keywords
    "checkpoint_reader": "families.qwen_image_edit.checkpoint:read_geometry",
    "text_encoder": "families.qwen_image_edit.encode:QwenImageEditPromptEncoder",
    "denoiser": "families.qwen_image_edit.denoise:QwenImageEditDenoiser",
    "decoder": "families.qwen_image.decode:QwenImageDecoder",
    "writer": "families.qwen_image_edit.init_model:write_checkpoint",
    "image_encoder": "families.qwen_image_edit.vae_encode:QwenImageEditLatentEncoder",
}
# The pipelines' defaults: 50 steps, true_cfg_scale 4; 1024x1024 is their default_sample_size, used only
# when no image gives the size.
_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=4.0)

QWEN_IMAGE_EDIT = Family(
    name="qwen-image-edit",
    pipeline="QwenImageEditPipeline",
    description=(
        "Qwen-Image-Edit: one input image, seen by Qwen2.5-VL with the prompt and VAE-encoded into the "
        "transformer's sequence; true CFG"
    ),
    class_name="QwenImageEditPipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    conditioning=CONDITIONING,
    defaults=_DEFAULTS,
    images=ImageInputs(
        roles=("reference",),
        required=("reference",),
        encoded_by=("text-encoder", "vae"),
        size_from=SizeFromImage(VAE_IMAGE_AREA, IMAGE_SIDE_MULTIPLE, index=0),
    ),
    # Its cluster test runs one rank per stage; the parallel cluster of the DiT and VAE code it shares with
    # Edit-Plus is Edit-Plus's.
    features=_features(_E2E + "test_qwen_image_edit_images_equal_pipeline", _PLUS_E2E, "QwenImageEdit"),
    **_COMPUTE,
)

QWEN_IMAGE_EDIT_PLUS = Family(
    name="qwen-image-edit-plus",
    pipeline="QwenImageEditPlusPipeline",
    description=(
        f"Qwen-Image-Edit-2509: 1 to {PLUS_MAX_IMAGES} reference images, each seen by Qwen2.5-VL at about "
        "384x384 pixels ('Picture n:') and VAE-encoded at about 1024x1024 into the transformer's sequence; "
        "the output takes the last image's aspect ratio"
    ),
    class_name="QwenImageEditPlusPipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    conditioning=CONDITIONING,
    defaults=_DEFAULTS,
    images=ImageInputs(
        roles=("reference",) * PLUS_MAX_IMAGES,
        required=("reference",),
        encoded_by=("text-encoder", "vae"),
        size_from=SizeFromImage(VAE_IMAGE_AREA, IMAGE_SIDE_MULTIPLE, index=-1),
    ),
    # Its one cluster runs the parallel DiT and VAE.
    features=_features(_PLUS_E2E, _PLUS_E2E, "QwenImageEditPlus"),
    **_COMPUTE,
)

FAMILIES = (QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS)
