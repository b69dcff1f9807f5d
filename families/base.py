"""What a model family declares about itself, as data.

A family is one kind of diffusers checkpoint (recognised by model_index.json) together with the code that
serves it. This module holds the declarations only and imports nothing heavy, so that the orchestrator, the
CLI and the docs can read every family's traits without loading torch. The compute of a family lives in its
own folder and is named here by import path ("package.module:Class"); a stage imports it when it loads.

What a stage asks of a family's compute (the protocols of stagekit/, the layer below families and stages:
stagekit/encoder.py, stagekit/denoise.py, stagekit/decode.py; the parts that build them are typed by
stagekit/family_parts.py):
- the text encoder: `encode(texts, max_sequence_length, namespace) -> ({name: [N, ...]}, cache_hit)`;
- the DiT: `denoise(spec, conditioning, on_step, cancelled) -> latents [1, C, T, H, W]`; for a family that makes
  sound with its video (LTX-2, stagekit.denoise.AudioDenoiser), `denoise_av(...) -> (video latents, audio latents)`;
- the VAE: `session().decode_next(latent_frame) -> uint8 frames [F, H, W, 3]` (`session(num_latent_frames)` for a
  decoder that needs the count: LTX-2's decodes at the last latent frame); for a family that makes sound,
  `decode_audio(audio_latents) -> (waveform float32 [channels, samples], sample rate)`; for a family that takes
  input images, `image_encoder(model_dir)(decoder, images, height, width, num_frames) -> {name: tensor}`,
  on the decoder's VAE.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    from stagekit.decode import LatentDecoder
    from stagekit.family_parts import (
        CheckpointWriter,
        DenoiserFactory,
        GeometryReader,
        GgufNames,
        ImageEncoderFactory,
        PromptEncoderFactory,
    )

# Every serving feature a family may support; docs/features.md is the table of families x features.
FEATURES = {
    "ulysses": "Ulysses SP (`--ulysses-degree`)",
    "ring": "Ring SP (`--ring-degree`)",
    "cfg_parallel": "CFG-parallel (`--cfg-parallel-size 2`)",
    "tensor_parallel": "Tensor parallel (`--tensor-parallel-size`)",
    "hsdp": "HSDP (`--use-hsdp`)",
    "vae_patch_parallel": "VAE patch parallel (`--vae-patch-parallel-size`)",
    "vae_tiling": "VAE tiling (`--vae-use-tiling`)",
    "cpu_offload": "Module-wise CPU offload (`--enable-cpu-offload`)",
    "layerwise_offload": "Layerwise offload (`--enable-layerwise-offload`)",
    "fp8": "FP8 weights (`--quantization fp8`)",
    "int8": "INT8 weights (`--quantization int8`)",
    "gguf": "GGUF weights (`--quantization gguf`, a `.gguf` transformer file)",
    "multithread_loading": "Multi-thread loading (`--num-weight-load-threads`)",
    "compile": "Regional compilation (`--compile`)",
    "interpolation": "Frame interpolation (`--interp-exp`)",
    "first_block_cache": "First-block cache (`cache.method first_block`)",
    "mag_cache": "MagCache (`cache.method mag`)",
    "teacache": "TeaCache (`cache.method teacache`)",
    "batching": "Request batching (`--max-batch-size`)",
    "step_scheduling": "Step-level scheduling (preemption, handoff, `--continuous-batching`)",
    "lora": "LoRA adapters per request (`--lora-dir`, `loras`)",
    "lora_fused": "LoRA adapters fused at startup (`--lora`)",
}

# Step caches a request may name (GenerateRequest.cache.method), the feature that says whether a family
# offers each, and the threshold a request that names only the method gets (dit_svc/step_cache/ says what
# each measures): MagCacheConfig's default; TeaCache's reference setting for Wan2.1 1.3B between its "slow"
# and "fast" ones; for the first-block cache 0.1, not FirstBlockCacheConfig's 0.05, which skips nothing on
# the Wan models (BENCHMARKS.md, "Step caches", has the measurements).
CACHE_FEATURES = {"first_block": "first_block_cache", "mag": "mag_cache", "teacache": "teacache"}
CACHE_METHODS = ("none", *CACHE_FEATURES)
DEFAULT_CACHE_THRESHOLDS = {"first_block": 0.1, "mag": 0.06, "teacache": 0.08}
# A threshold is a relative change (first_block) or an accumulated one (mag, teacache); above 1 every
# method skips nearly every step, which no request needs.
MAX_CACHE_THRESHOLD = 1.0

# Optional file in a checkpoint, written by `stagediff init-model`: the request its preset is sized for.
DEFAULTS_FILE = "stagediff.json"


@dataclass(frozen=True)
class Support:
    """A supported cell names the tests behind it (`path::test_name`, or `path::TestClass` for a class that
    combines the family's tester config with the feature's mixin, tests/helpers/feature_mixins/); an
    unsupported one says why.

    An unsupported cell whose flag the stage refuses at startup names the tests of that refusal in
    `refusal_tests`, so that a user who passes the flag anyway gets an error, never a wrong result.
    """

    tests: tuple[str, ...] = ()
    reason: str = ""
    refusal_tests: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return bool(self.tests)

    @property
    def refused_at_startup(self) -> bool:
        return not self.supported and bool(self.refusal_tests)

    def cell(self) -> str:
        """The table cell: "yes", or "no: " with the reason (and how the stage refuses the flag)."""
        if self.supported:
            return "yes"
        return f"no: {self.reason}; refused at startup" if self.refused_at_startup else f"no: {self.reason}"


_LORA_TESTS = "tests/integration/test_lora.py::"
_LORA_REFUSED = (_LORA_TESTS + "test_adapters_per_request_are_refused_with_options_they_cannot_follow",)
# How adapters applied per request (--lora-dir) combine with the DiT's other options, for every family that
# serves them (docs/features.md shows it; `stagediff serve dit` refuses each unsupported combination with its
# reason). Adapters fused at startup (--lora) change the base weights before quantization, offload, the parallel
# plan and compilation, so they combine with all of those but TP and HSDP, which load each rank's shards.
LORA_WITH: dict[str, Support] = {
    "ulysses": Support(tests=(_LORA_TESTS + "test_adapters_under_parallel_layouts_equal_one_rank",)),
    "ring": Support(tests=(_LORA_TESTS + "test_adapters_under_parallel_layouts_equal_one_rank",)),
    "cfg_parallel": Support(tests=(_LORA_TESTS + "test_adapters_under_parallel_layouts_equal_one_rank",)),
    "tensor_parallel": Support(
        reason="the adapters' layers would have to be sharded like the heads and MLPs they wrap, which is not "
        "built; use sequence or CFG parallelism, or fuse the adapter with --lora",
        refusal_tests=_LORA_REFUSED,
    ),
    "hsdp": Support(
        reason="FSDP2 shards each block's parameters once, and adapters loaded later would not be sharded; use "
        "sequence or CFG parallelism",
        refusal_tests=_LORA_REFUSED,
    ),
    "fp8": Support(
        reason="PEFT's layers wrap full-precision linears, and applying an adapter on a quantized layer's "
        "dequantized path is not built; fuse the adapter with --lora, which is applied before quantization",
        refusal_tests=_LORA_REFUSED,
    ),
    "int8": Support(
        reason="as for FP8: PEFT's layers wrap full-precision linears; fuse the adapter with --lora instead",
        refusal_tests=_LORA_REFUSED,
    ),
    "gguf": Support(
        reason="a GGUF layer keeps its weight packed, and the adapters' shape checks and PEFT's layers read the "
        "linear's weight; serve the safetensors weights with the adapter, or fuse it before converting to GGUF",
        refusal_tests=(
            "tests/integration/test_gguf.py::test_gguf_is_chosen_by_the_file_and_refused_where_it_cannot_work",
        ),
    ),
    "cpu_offload": Support(
        reason="adapters are loaded into the transformer while requests run, and the offload hooks move the "
        "weights they knew at startup",
        refusal_tests=_LORA_REFUSED,
    ),
    "layerwise_offload": Support(
        reason="as for module-wise offload: the hooks stream the weights they knew at startup",
        refusal_tests=_LORA_REFUSED,
    ),
    "compile": Support(
        reason="each new set of adapters changes the compiled blocks' modules and would compile them again; fuse "
        "the adapter with --lora, which compiles once",
        refusal_tests=_LORA_REFUSED,
    ),
    "first_block_cache": Support(tests=(_LORA_TESTS + "test_adapters_with_a_step_cache_equal_diffusers_hooks",)),
    "batching": Support(tests=(_LORA_TESTS + "test_requests_share_a_batch_only_with_the_same_adapters",)),
}
# The cell of a family whose pipeline's LoRA loading is not checked against ours yet.
LORA_UNVERIFIED = Support(
    reason="not verified yet against its pipeline's load_lora_weights",
    refusal_tests=(_LORA_TESTS + "test_adapters_are_refused_at_startup_where_unverified",),
)


# Roles of input images (stagediff.v1.ImageRole without its prefix, lower case).
IMAGE_ROLES = ("first_frame", "last_frame", "reference")


@dataclass(frozen=True)
class TensorSlot:
    """A conditioning tensor the DiT takes, by the name it travels under from the stage that makes it.

    `kind`: "embeds" [1, L, dim]; "pooled" [1, dim], one vector per text (FLUX's CLIP pooled output, of the
    denoiser's `pooled_dim`); "mask" [1, L] of embeddings named by `of` (its length must match them);
    "latents" [1, C, T, h, w]; "packed" [1, N, channels], latents packed into a token sequence (Qwen-Image's
    2x2 patches), several images' tokens one after another. `needed`: "always"; "cfg" (only when
    guidance_scale > 1); "image" (when the request sends input images); "optional". `source`: the stage
    that sends it, the text encoder (which also encodes images for the families that embed them) or the
    VAE's Encode.
    """

    name: str
    kind: Literal["embeds", "pooled", "mask", "latents", "packed"]
    needed: Literal["always", "cfg", "image", "optional"]
    of: str | None = None
    source: Literal["text-encoder", "vae"] = "text-encoder"
    # Made from the input images; its shape is the denoiser's `image_tensor_shape(name, spec)`.
    image: bool = False
    # "embeds": the denoiser property giving their width (a second text encoder's own width: HunyuanVideo 1.5's
    # ByT5 glyph embeddings, `glyph_dim`).
    width: str = "text_dim"
    # "mask": whether it may mark no token (embeddings a text may lack: a prompt without quoted glyph text).
    may_be_empty: bool = False

    @property
    def datatypes(self) -> tuple[str, ...]:
        return ("INT64", "INT32", "BOOL") if self.kind == "mask" else ("FP32", "BF16", "FP16")

    @property
    def ndim(self) -> int:
        return {"embeds": 3, "pooled": 2, "mask": 2, "latents": 5, "packed": 3}[self.kind]

    def is_needed(self, guidance: bool, images: bool) -> bool:
        return self.needed == "always" or (self.needed == "cfg" and guidance) or (self.needed == "image" and images)


def calculate_dimensions(area: int, width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) of about `area` pixels with the aspect ratio of a `width` x `height` image, each side
    rounded to a multiple of `multiple`: `calculate_dimensions` of diffusers' Qwen-Image edit pipelines,
    step for step (the height from the unrounded width, Python's rounding). A side may round to 0."""
    ratio = width / height
    exact_width = math.sqrt(area * ratio)
    exact_height = exact_width / ratio
    return round(exact_width / multiple) * multiple, round(exact_height / multiple) * multiple


def nearest_resolution(
    width: int, height: int, multiple: int, resolutions: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """(width, height) of the listed resolution whose aspect ratio is nearest a `width` x `height` image's, as
    FluxKontextPipeline's `_auto_resize` picks it: each image side first floored to a multiple of `multiple`
    (its image processor's default size), ties to the smaller width, the pick floored to `multiple` again.
    (0, 0) for an image less than `multiple` pixels high or wide, which has no such aspect ratio (the
    pipeline divides by zero for the height, and takes a ratio of 0 for the width)."""
    floored_width, floored_height = width - width % multiple, height - height % multiple
    if floored_width < 1 or floored_height < 1:
        return 0, 0
    ratio = floored_width / floored_height
    _, picked_width, picked_height = min((abs(ratio - w / h), w, h) for w, h in resolutions)
    return picked_width // multiple * multiple, picked_height // multiple * multiple


def crop_bucket(width: int, height: int, base: int, multiple: int) -> tuple[int, int]:
    """(width, height) of the crop bucket of about `base`^2 pixels nearest a `width` x `height` image's aspect
    ratio, as HunyuanVideo 1.5's image processor picks it (`calculate_default_height_width`): the buckets are the
    (columns x rows) grids of `multiple`-pixel patches of about (base / multiple)^2 patches and at most 4:1, and the
    pick is the nearest ratio on the far side of 1 from the image's (a landscape image never gets a portrait
    bucket). The buckets list their sides as (first, second) and the pipeline reads the pick as (height, width)."""
    patches = round((base / multiple) ** 2)
    buckets, columns, rows = [], patches, 1
    while columns > 0:
        if max(columns, rows) / min(columns, rows) <= 4.0:
            buckets.append((columns * multiple, rows * multiple))
        if (rows + 1) * columns <= patches:
            rows += 1
        else:
            columns -= 1
    wanted = height / width
    ratios = [round(first / second, 5) for first, second in buckets]
    if wanted >= 1:
        candidates = [index for index, ratio in enumerate(ratios) if ratio - wanted <= 0]
    else:
        candidates = [index for index, ratio in enumerate(ratios) if ratio - wanted >= 0]
    best = min(candidates, key=lambda index: abs(ratios[index] - wanted))
    picked_height, picked_width = buckets[best]
    return picked_width, picked_height


@dataclass(frozen=True)
class SizeFromImage:
    """The output size a request leaves unset, made from one of its input images as the family's pipeline
    makes it: `calculate_dimensions(area, image width / image height)`, sides multiples of `multiple`; or,
    with `resolutions`, the one of them nearest the image's aspect ratio (`nearest_resolution`); or, with
    `buckets`, the model's crop bucket nearest it (`crop_bucket` of ModelLimits.image_size_base)."""

    area: int
    # 0: the model's own multiple (ModelLimits.height_multiple, its VAE's factor times the patch), which
    # FluxKontextPipeline's `multiple_of` is.
    multiple: int
    # Which image, in the family's role order: 0 the first (QwenImageEditPipeline), -1 the last
    # (QwenImageEditPlusPipeline).
    index: int = 0
    # (width, height) pairs the family's pipeline picks from by aspect ratio (FluxKontextPipeline's
    # PREFERRED_KONTEXT_RESOLUTIONS); `area` plays no part then.
    resolutions: tuple[tuple[int, int], ...] = ()
    # The model's crop buckets (HunyuanVideo 1.5 image-to-video); `area` plays no part then.
    buckets: bool = False
    # The pipeline takes no size at all, only the image's: a request's height and width, where set, must be it.
    fixed: bool = False

    def size(self, width: int, height: int, model_multiple: int = 0, base: int = 0) -> tuple[int, int]:
        """(width, height) for an input image of `width` x `height` pixels (as decoded, EXIF orientation
        applied); `model_multiple` is the model's, used where the rule declares none, and `base` its
        ModelLimits.image_size_base, which the bucket rule needs. A side may be 0."""
        multiple = self.multiple or model_multiple
        if multiple < 1:
            raise ValueError("this size rule takes the model's multiple; pass model_multiple")
        if self.buckets:
            if base < multiple:
                raise ValueError(f"the bucket rule takes the model's image_size_base, not {base}")
            return crop_bucket(width, height, base, multiple)
        if self.resolutions:
            return nearest_resolution(width, height, multiple, self.resolutions)
        return calculate_dimensions(self.area, width, height, multiple)


@dataclass(frozen=True)
class ImageInputs:
    """The input images a family takes: their roles (the first is what an unspecified role means) and the
    roles a request must send. A role listed n times may be sent up to n times (the reference images of
    Qwen-Image-Edit-Plus); every other role at most once. A checkpoint may narrow this (checkpoint.py: a
    first-last-frame Wan model requires the last frame too)."""

    roles: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    # The stages that see the images: the VAE (Encode) always, the text encoder where the family embeds
    # the image itself (CLIP in Wan2.1 image-to-video, Qwen2.5-VL in Qwen-Image-Edit).
    encoded_by: tuple[Literal["text-encoder", "vae"], ...] = ()
    # Where the family's pipeline takes the output size from an input image when the request leaves height
    # and width unset (None: the request defaults apply).
    size_from: SizeFromImage | None = None


@dataclass(frozen=True)
class RequestDefaults:
    """Used for fields a request leaves unset; the Wan2.1 reference values unless a family says otherwise."""

    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    fps: float = 16.0
    # The guidance a guidance-distilled transformer takes as an input (FLUX.1-dev's guidance embedding);
    # None for a model without one.
    embedded_guidance_scale: float | None = None


# The parts of a Family named by import path, the argument of `Family.load`.
FamilyPart = Literal[
    "checkpoint_reader", "text_encoder", "denoiser", "decoder", "image_encoder", "writer", "gguf_names"
]


@dataclass(frozen=True)
class Family:
    name: str
    pipeline: str  # the diffusers pipeline class that is the reference for correctness
    description: str
    # How the registry recognises the family's checkpoints: model_index.json's `_class_name`, and the
    # components and config entries it must name (the most specific family of a class is tried first).
    class_name: str
    requires: tuple[str, ...]
    output: Literal["video", "image"]
    # The stages a request runs through, in order. A stage in `optional_stages` runs only when the request
    # asks for it (interpolation); a deployment may leave it out.
    chain: tuple[str, ...]
    optional_stages: tuple[str, ...]
    conditioning: tuple[TensorSlot, ...]
    defaults: RequestDefaults
    # Import paths ("module:attribute") of the family's compute, loaded by the stage that runs it (`load`); each
    # part's type is its protocol in stagekit/family_parts.py.
    checkpoint_reader: str  # GeometryReader: (configs) -> CheckpointSpec fields
    text_encoder: str  # PromptEncoderFactory: a PromptEncoder class
    denoiser: str  # DenoiserFactory: a Denoiser class
    decoder: str  # a LatentDecoder subclass (DecoderFactory)
    writer: str  # CheckpointWriter, for init-model: (family, out, preset, seed, save_kwargs) -> None
    # ImageEncoderFactory: the VAE stage's Encode of input images, for families that take them ("" for text-only
    # families).
    image_encoder: str = ""
    images: ImageInputs = ImageInputs()
    features: dict[str, Support] = field(default_factory=dict)
    # init-model presets with trained weights shipped in the package, copied rather than written:
    # preset name -> "package:directory" of a checkpoint inside that package.
    trained_presets: dict[str, str] = field(default_factory=dict)
    # init-model presets with random weights that only this family writes, beyond the "tiny" and "small" every
    # family has: preset name -> what it is (its writer knows how to write it). Used for the published
    # checkpoints' real configs, so that memory and load times are measured at real size.
    own_presets: dict[str, str] = field(default_factory=dict)
    # GGUF files of the family's transformer (families/gguf.py, stagekit/gguf.py): "module:function" giving the
    # name such files use for a diffusers state-dict key, and their `general.architecture` ("" for both where
    # the family serves no GGUF weights).
    gguf_names: str = ""
    gguf_arch: str = ""
    # "module:Class" of the adapter loader (`lora_state_dict`, `load_lora_into_transformer`), where the family
    # reads more layouts than its pipeline's own loader (FLUX.1: BFL's lora_A/lora_B names); "" for the pipeline's.
    lora_loader: str = ""
    # The request's guidance_scale above which the family runs CFG with the negative prompt (the orchestrator then
    # encodes and sends it): 1 for the pipelines that guide as `negative + scale * (positive - negative)`, where
    # a scale of 1 is the positive prediction alone; 0 for those that guide as `positive + scale * (positive -
    # negative)` (ZImagePipeline), where any scale above 0 guides.
    cfg_threshold: float = 1.0

    def support(self, feature: str) -> Support:
        return self.features.get(feature, Support(reason="not implemented for this family yet"))

    def refuse_unsupported(self, feature: str) -> None:
        """Raises ValueError with the reason when the family cannot serve a feature."""
        support = self.support(feature)
        if not support.supported:
            raise ValueError(f"{FEATURES[feature]} is not supported for {self.name}: {support.reason}")

    def uses_stage(self, stage: str) -> bool:
        return stage in self.chain

    def required_stages(self) -> tuple[str, ...]:
        return tuple(stage for stage in self.chain if stage not in self.optional_stages)

    @overload
    def load(self, part: Literal["checkpoint_reader"]) -> GeometryReader: ...
    @overload
    def load(self, part: Literal["text_encoder"]) -> PromptEncoderFactory: ...
    @overload
    def load(self, part: Literal["denoiser"]) -> DenoiserFactory: ...
    @overload
    def load(self, part: Literal["decoder"]) -> type[LatentDecoder]: ...
    @overload
    def load(self, part: Literal["image_encoder"]) -> ImageEncoderFactory: ...
    @overload
    def load(self, part: Literal["writer"]) -> CheckpointWriter[Family]: ...
    @overload
    def load(self, part: Literal["gguf_names"]) -> GgufNames: ...
    @overload
    def load(self, part: FamilyPart) -> object: ...
    def load(self, part: FamilyPart) -> Any:
        """The family's compute for one part, imported now (it may import torch)."""
        module, _, attribute = getattr(self, part).partition(":")
        return getattr(importlib.import_module(module), attribute)
