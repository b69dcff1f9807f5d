"""FLUX.1 Kontext image editing (FluxKontextPipeline): FLUX.1-dev's CLIP + T5 text encoders, transformer and
AutoencoderKL, with the reference image's latents in the transformer's image sequence.

Declarations only (no torch). The compute is FLUX.1's (families/flux/: the prompt encoder, the decode, the
parallel plan) with what Kontext adds beside this file: vae_encode.py (the reference image resized to the
preferred resolution nearest its aspect ratio, VAE-encoded and packed), denoise.py (the image tokens after the
noise tokens, with ids whose first coordinate is 1) and init_model.py.

How a request maps onto FluxKontextPipeline's arguments:
- the reference image is optional, as in the pipeline (without one it generates from the text alone); it is
  always resized as `_auto_resize=True` (the pipeline's default) resizes it: to the one of
  PREFERRED_KONTEXT_RESOLUTIONS nearest its aspect ratio, each side floored to the model's multiple;
- the output is the request's height x width, which is the pipeline's output for that height and width with
  `max_area=height * width` (the pipeline rescales any size to `max_area` pixels at the same aspect ratio: with
  its default of 1024 * 1024 every output would be about a megapixel);
- a request that leaves height and width unset gets the size the reference image is resized to, as FLUX.1
  Kontext's reference inference sizes its output (FluxKontextPipeline itself would make 1024x1024 whatever the
  image's shape); without an image, the defaults (1024x1024);
- `embedded_guidance_scale` is the pipeline's `guidance_scale` (the guidance embedding, 3.5 by default),
  `guidance_scale` its `true_cfg_scale` with the negative prompt, as for FLUX.1 (families/flux/family.py).
"""

from __future__ import annotations

from families.base import Family, ImageInputs, SizeFromImage, Support, TensorSlot
from families.flux.family import FLUX

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height): the sizes Kontext is trained on.
PREFERRED_KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)
# The reference image's size, and the output's when the request leaves it unset: the preferred resolution
# nearest the image's aspect ratio, sides floored to the model's multiple (the VAE's factor times 2).
REFERENCE_SIZE = SizeFromImage(area=0, multiple=0, index=0, resolutions=PREFERRED_KONTEXT_RESOLUTIONS)

_TESTS = "tests/integration/test_family_flux_kontext.py::"
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestFluxKontext"
_PARALLEL = _FEATURE_CLASSES + "ParallelLayouts"
# Its VAE stage encodes the reference image and decodes in row bands over two ranks.
_CLUSTER = "tests/e2e/test_image_families_cluster.py::test_flux_kontext_cluster_edits_equal_pipeline"

FLUX_KONTEXT = Family(
    name="flux-kontext",
    pipeline="FluxKontextPipeline",
    description=(
        "FLUX.1 Kontext image editing: FLUX.1-dev's CLIP and T5 encoders, transformer and AutoencoderKL, the "
        "reference image resized to the preferred resolution nearest its aspect ratio and its packed latents after "
        "the noise tokens (ids with first coordinate 1); the output is the request's size (the pipeline's with "
        "max_area = height * width), else the reference image's resized size; embedded_guidance_scale is the "
        "pipeline's guidance_scale, guidance_scale its true_cfg_scale"
    ),
    class_name="FluxKontextPipeline",
    requires=(),
    output="image",
    chain=("text-encoder", "dit", "vae"),
    optional_stages=(),
    conditioning=(
        *FLUX.conditioning,
        TensorSlot("image_latents", "packed", "image", source="vae", image=True),
    ),
    # FluxKontextPipeline's: 28 steps, guidance 3.5 embedded, true CFG off; 1024x1024 without an image.
    defaults=FLUX.defaults,
    checkpoint_reader="families.flux.checkpoint:read_geometry",
    text_encoder="families.flux.encode:FluxPromptEncoder",
    denoiser="families.flux_kontext.denoise:FluxKontextDenoiser",
    decoder="families.flux.decode:FluxDecoder",
    writer="families.flux_kontext.init_model:write_checkpoint",
    image_encoder="families.flux_kontext.vae_encode:FluxKontextLatentEncoder",
    images=ImageInputs(roles=("reference",), required=(), encoded_by=("vae",), size_from=REFERENCE_SIZE),
    features={
        "ulysses": Support(tests=(_PARALLEL,)),
        "ring": Support(tests=(_PARALLEL,)),
        "cfg_parallel": Support(tests=(_PARALLEL,)),
        "tensor_parallel": Support(tests=(_PARALLEL,)),
        "hsdp": Support(tests=(_PARALLEL,)),
        "vae_patch_parallel": Support(
            tests=(
                "tests/integration/test_autoencoder_kl_patch_parallel.py::test_kl_patch_parallel_equals_whole_decode",
                _CLUSTER,
            )
        ),
        "vae_tiling": FLUX.support("vae_tiling"),
        "gguf": FLUX.support("gguf"),
        "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
        "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
        "fp8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "int8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
        "multithread_loading": Support(tests=(_FEATURE_CLASSES + "Loading",)),
        "compile": Support(tests=(_FEATURE_CLASSES + "Compile",)),
        "interpolation": FLUX.support("interpolation"),
        "first_block_cache": Support(tests=(_FEATURE_CLASSES + "StepCache",)),
        "mag_cache": Support(tests=(_FEATURE_CLASSES + "StepCache",)),
        "teacache": FLUX.support("teacache"),
        "batching": Support(
            reason="not built yet: each request's reference image adds its own tokens to the sequence, which a "
            "batch would have to match in size and order; FLUX.1's batch loop does not take them"
        ),
        # diffusers' format through FluxKontextPipeline's loader (FLUX.1's, with the community formats it converts).
        "lora": Support(
            tests=(
                _FEATURE_CLASSES + "LoRA",
                "tests/integration/test_lora.py::test_adapters_under_parallel_layouts_equal_one_rank",
            )
        ),
        "lora_fused": Support(tests=(_FEATURE_CLASSES + "LoRA",)),
    },
)

FAMILIES = (FLUX_KONTEXT,)
