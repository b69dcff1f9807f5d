"""LTX-2 text-to-audio+video and image-to-audio+video: a Gemma 3 text encoder with LTX2TextConnectors,
LTX2VideoTransformer3DModel (one transformer denoising video and audio latents together), AutoencoderKLLTX2Video
(32x spatial, 8x temporal), AutoencoderKLLTX2Audio and a vocoder (LTX2Vocoder, or LTX2VocoderWithBWE in LTX-2.3).

Declarations only (no torch); the compute is beside this file: encode.py (Gemma 3 and both connectors, in the text
encoder stage), denoise.py (the joint audio-video loop with LTX2Pipeline's guidance, in the DiT stage), decode.py
(the video VAE, and the audio VAE and vocoder, both in the VAE stage), checkpoint.py and init_model.py.

The stages carry both modalities: the DiT stage sends the video latents frame by frame as for every video family,
then the audio latents ("audio_latents" [1, Ca, A, M], stagekit.denoise.AudioDenoiser); the VAE stage sends the
frames (all at the last latent frame: the published decoders are not causal in time, decode.py) and then the
waveform ("audio" FP32 [channels, samples] at ModelLimits.audio_sample_rate, the vocoder's rate). The request's fps
is LTX2Pipeline's `frame_rate` (DenoiseParams.fps): the sound lasts num_frames / fps seconds. The orchestrator takes
the sound past the interpolator to the result: interpolated frames raise the frame rate, never the video's length.

Image-to-video (`ltx-2-i2v`, LTX2ImageToVideoPipeline) is the same loop with the request's first frame kept clean:
the VAE stage's Encode makes its latents (families/ltx2/vae_encode.py: the image re-compressed as H.264 and resized
as the pipeline does, the mode of the video VAE's encoding, normalised), the DiT puts them at latent frame 0, gives
that frame's tokens timestep 0 and steps only the later frames (families/ltx2/denoise.py); the sound is made as in
text-to-video. The output size is the request's (the pipeline resizes the image to it, whatever its aspect ratio).

The request's guidance_scale is LTX2Pipeline's `guidance_scale` (the video's CFG scale). The pipeline's other
guidance (audio CFG at 7.0, spatio-temporal guidance, modality guidance, rescale) runs at its defaults
(families/ltx2/guidance.py `LTX2Guidance`). Its audio CFG runs at every video scale, so the negative prompt is
always needed: `cfg_threshold` is below the lowest guidance_scale a request may send (0).
"""

from __future__ import annotations

from families.base import Family, ImageInputs, RequestDefaults, Support, TensorSlot

CHAIN = ("text-encoder", "dit", "vae", "interp")
# Per text, the connectors' output (families/ltx2/encode.py): the video stream's embeddings (width `text_dim`),
# the audio stream's (width `audio_text_dim`) and the one mask both streams attend with. With the published
# connectors' learnable registers every position is real and the mask is all ones.
CONDITIONING = (
    TensorSlot("prompt_video_embeds", "embeds", "always"),
    TensorSlot("prompt_audio_embeds", "embeds", "always", width="audio_text_dim"),
    TensorSlot("prompt_embeds_mask", "mask", "optional", of="prompt_video_embeds"),
    TensorSlot("negative_prompt_video_embeds", "embeds", "cfg"),
    TensorSlot("negative_prompt_audio_embeds", "embeds", "cfg", width="audio_text_dim"),
    TensorSlot("negative_prompt_embeds_mask", "mask", "optional", of="negative_prompt_video_embeds"),
)
# LTX2Pipeline runs CFG when its video or its audio scale is above 1, and its audio scale defaults to 7.0.
CFG_THRESHOLD = -1.0

_NOT_BUILT = "not built yet for LTX-2"
# The family's classes in tests/integration/test_family_features.py (LTX2TesterConfig with a feature's mixin): each
# compares the video latents and the audio latents the DiT stage sends.
_FEATURE_CLASSES = "tests/integration/test_family_features.py::TestLTX2"
FEATURES = {
    "ulysses": Support(reason=f"{_NOT_BUILT}: no sequence-parallel plan for the joint video and audio sequences"),
    "ring": Support(reason=f"{_NOT_BUILT}: no sequence-parallel plan for the joint video and audio sequences"),
    "cfg_parallel": Support(reason=f"{_NOT_BUILT}: the CFG, STG and modality passes run one after the other"),
    "tensor_parallel": Support(reason=f"{_NOT_BUILT}: no tensor-parallel plan for LTX2VideoTransformerBlock"),
    "hsdp": Support(
        tests=(
            _FEATURE_CLASSES + "ParallelLayouts",
            "tests/integration/test_ltx2_stages.py::test_hsdp_group_sends_the_pipelines_video_and_audio_latents",
        )
    ),
    "vae_patch_parallel": Support(reason=f"{_NOT_BUILT}: no row-band plan for AutoencoderKLLTX2Video's decoder"),
    "vae_tiling": Support(reason="tiled decode is implemented for the Wan VAE only; this VAE decodes the video whole"),
    "cpu_offload": Support(tests=(_FEATURE_CLASSES + "ModuleOffload",)),
    "layerwise_offload": Support(tests=(_FEATURE_CLASSES + "LayerwiseOffload",)),
    "fp8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
    "int8": Support(tests=(_FEATURE_CLASSES + "Quantization",)),
    "gguf": Support(reason=f"{_NOT_BUILT}: no GGUF tensor names are mapped for LTX2VideoTransformer3DModel"),
    "multithread_loading": Support(
        tests=(
            _FEATURE_CLASSES + "Loading",
            "tests/e2e/test_ltx2_cluster.py::test_raw_frames_and_sound_equal_the_pipeline",
        )
    ),
    "compile": Support(
        reason=f"{_NOT_BUILT}: its check compiles six graphs of the joint audio-video block (the CFG batch, the "
        "single passes, the modality-isolated pass), minutes on a CPU, too long for the test suite",
        refusal_tests=("tests/integration/test_compile.py::test_compile_is_refused_at_startup_where_unverified",),
    ),
    "interpolation": Support(
        tests=("tests/e2e/test_ltx2_cluster.py::test_interpolation_doubles_the_frames_and_keeps_the_sound",)
    ),
    "first_block_cache": Support(reason=f"{_NOT_BUILT}: not checked against diffusers' hooks"),
    "mag_cache": Support(reason=f"{_NOT_BUILT}: not checked against diffusers' hooks"),
    "teacache": Support(reason="TeaCache's rescaling polynomials are published for Wan2.1 only"),
    "batching": Support(reason=f"{_NOT_BUILT}: one request at a time"),
    "lora": Support(reason=f"{_NOT_BUILT}: not verified against LTX2Pipeline's load_lora_weights"),
    "lora_fused": Support(reason=f"{_NOT_BUILT}: not verified against LTX2Pipeline's load_lora_weights"),
}

LTX2 = Family(
    name="ltx-2",
    pipeline="LTX2Pipeline",
    description="LTX-2 text-to-video with audio (Gemma 3 text encoder and LTX2TextConnectors, "
    "LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video, AutoencoderKLLTX2Audio, a vocoder); guidance_scale is the "
    "video's CFG scale, the other guidance at LTX2Pipeline's defaults",
    class_name="LTX2Pipeline",
    requires=(),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=CONDITIONING,
    # LTX2Pipeline.__call__'s defaults: 512x768, 121 frames (its num_frames=None without a duration head) at 24 fps,
    # 30 steps, guidance_scale 3.0.
    defaults=RequestDefaults(
        height=512, width=768, num_frames=121, num_inference_steps=30, guidance_scale=3.0, fps=24.0
    ),
    checkpoint_reader="families.ltx2.checkpoint:read_geometry",
    text_encoder="families.ltx2.encode:LTX2PromptEncoder",
    denoiser="families.ltx2.denoise:LTX2Denoiser",
    # The video VAE, and the audio VAE and vocoder: one VAE stage decodes both modalities (docs/design.md).
    decoder="families.ltx2.decode:LTX2Decoder",
    writer="families.ltx2.init_model:write_checkpoint",
    features=FEATURES,
    own_presets={
        "tiny-2.0": "the tiny sizes in LTX-2.0's layout (Lightricks/LTX-2: the transformer's caption projection, one "
        "text projection shared by both connectors, no STG perturbation, LTX2Vocoder at 24 kHz); tiny and small "
        "follow LTX-2.3's",
        "ltx-2-config": "Lightricks/LTX-2's published configs (19B transformer, Gemma-3-12B, the connectors, video "
        "and audio VAEs, LTX2Vocoder), random bf16 weights, written streamed",
        "ltx-2.3-config": "Lightricks/LTX-2.3's published configs (19B transformer, Gemma-3-12B, the connectors, video "
        "and audio VAEs, LTX2VocoderWithBWE), random bf16 weights, written streamed",
    },
    cfg_threshold=CFG_THRESHOLD,
)

# Image-to-video: the features as text-to-video's, but for the DiT's options, whose checks (the feature classes of
# LTX2TesterConfig) run text-to-video only, and interpolation, checked with an image as the first frame.
_I2V_UNCHECKED = "checked for text-to-video (ltx-2) only, not yet with the image at the first latent frame"
I2V_FEATURES = {
    **{
        name: Support(reason=_I2V_UNCHECKED) if any(test.startswith(_FEATURE_CLASSES) for test in cell.tests) else cell
        for name, cell in FEATURES.items()
    },
    "interpolation": Support(
        tests=("tests/e2e/test_ltx2_cluster.py::test_image_to_video_beside_text_to_video_equals_the_pipeline",)
    ),
}

LTX2_I2V = Family(
    name="ltx-2-i2v",
    pipeline="LTX2ImageToVideoPipeline",
    description="LTX-2 image-to-video with audio: the first frame's latents (the video VAE's Encode) kept clean at "
    "latent frame 0 while the later frames and the sound are denoised, as LTX2ImageToVideoPipeline makes them; "
    "the image is resized to the request's size; guidance_scale is the video's CFG scale",
    class_name="LTX2ImageToVideoPipeline",
    requires=(),
    output="video",
    chain=CHAIN,
    optional_stages=("interp",),
    conditioning=(*CONDITIONING, TensorSlot("image_latents", "latents", "always", source="vae", image=True)),
    # LTX2ImageToVideoPipeline.__call__'s defaults are LTX2Pipeline's.
    defaults=LTX2.defaults,
    images=ImageInputs(roles=("first_frame",), required=("first_frame",), encoded_by=("vae",)),
    checkpoint_reader=LTX2.checkpoint_reader,
    text_encoder=LTX2.text_encoder,
    image_encoder="families.ltx2.vae_encode:LTX2ImageLatentEncoder",
    denoiser=LTX2.denoiser,
    decoder=LTX2.decoder,
    writer=LTX2.writer,
    features=I2V_FEATURES,
    own_presets=LTX2.own_presets,
    cfg_threshold=CFG_THRESHOLD,
)

FAMILIES = (LTX2, LTX2_I2V)
