"""The geometry of an LTX-2 checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults

# LTX2Pipeline.__call__'s defaults: 512x768 pixels, 121 frames at 24 frames per second (num_frames=None gives 121
# without a duration head), 30 steps, guidance_scale 3.0.
HEIGHT, WIDTH = 512, 768
NUM_FRAMES = 121
FPS = 24.0
NUM_INFERENCE_STEPS = 30
GUIDANCE_SCALE = 3.0
# LTX2Pipeline's max_sequence_length: every text is padded (on the left) to this many Gemma tokens, and the
# connectors' output has this length (their learnable registers fill the padding).
MAX_SEQUENCE_LENGTH = 1024
# The vocoder classes' default output rates (diffusers' LTX2Vocoder and LTX2VocoderWithBWE), for a config that
# leaves output_sampling_rate out.
VOCODER_SAMPLE_RATES = {"LTX2Vocoder": 24_000, "LTX2VocoderWithBWE": 48_000}


def audio_format(vocoder: dict[str, Any]) -> tuple[int, int]:
    """(sample rate, channels) of the waveform the vocoder gives: its `output_sampling_rate` (24 kHz for LTX2Vocoder,
    LTX-2.0; 48 kHz for LTX2VocoderWithBWE, LTX-2.3) and its `out_channels` (2, stereo, in both)."""
    name = vocoder.get("_class_name", "")
    if name not in VOCODER_SAMPLE_RATES:
        raise ValueError(f"vocoder class {name!r} is not one of {', '.join(VOCODER_SAMPLE_RATES)}")
    rate = int(vocoder.get("output_sampling_rate", VOCODER_SAMPLE_RATES[name]))
    return rate, int(vocoder.get("out_channels", 2))


def compression(vae: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of AutoencoderKLLTX2Video: its config's ratios (32 and 8 published), or, where
    a config leaves them out, what the class computes (the patch size times 2 per scaling block)."""
    scaling = vae.get("spatio_temporal_scaling", (True, True, True, True))
    if isinstance(scaling, bool):
        scaling = [scaling] * (len(vae.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
    doublings = sum(1 for scales in scaling if scales)
    spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * 2**doublings
    temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * 2**doublings
    return int(spatial), int(temporal)


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A video model: AutoencoderKLLTX2Video latents (32x spatial and 8x temporal compression, 128 channels in the
    published VAE), the transformer's patch sizes (1x1x1 published), Gemma prompts padded to 1024 tokens, and
    LTX2Pipeline's defaults; and the sound's sample rate and channels, from the vocoder's config."""
    vae, transformer = configs["vae"], configs["transformer"]
    duration_head = configs.get("model_index", {}).get("duration_head")
    if isinstance(duration_head, list) and duration_head and duration_head[0] is not None:
        raise ValueError(
            "its model_index.json lists a duration_head, with which LTX2Pipeline picks the video's length from the "
            "prompt when a request leaves num_frames out; that is not served (every request here gets the model's "
            "default num_frames), so serve a checkpoint without one (LTX-2.0, LTX-2.3)"
        )
    if "vocoder" not in configs:
        raise ValueError("an LTX-2 checkpoint names a vocoder in its model_index.json; this one does not")
    sample_rate, channels = audio_format(configs["vocoder"])
    spatial, temporal = compression(vae)
    patch, patch_t = int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1))
    return {
        "vae_scale_spatial": spatial,
        "vae_scale_temporal": temporal,
        "patch_size": (patch_t, patch, patch),
        "latent_channels": int(vae.get("latent_channels", 128)),
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "sequence_length_limit": MAX_SEQUENCE_LENGTH,
        "audio_sample_rate": sample_rate,
        "audio_channels": channels,
        "defaults": RequestDefaults(
            height=HEIGHT,
            width=WIDTH,
            num_frames=NUM_FRAMES,
            num_inference_steps=NUM_INFERENCE_STEPS,
            guidance_scale=GUIDANCE_SCALE,
            fps=FPS,
        ),
    }
