"""Random-weight LTX-2 checkpoints in the published diffusers layout (`--family ltx-2`).

Every component of LTX2Pipeline's model_index.json with the real classes: a Gemma 3 text encoder
(Gemma3ForConditionalGeneration, the class the pipeline is typed for, with a one-layer SigLIP vision tower the
class requires and the pipeline never runs) and a locally trained Gemma tokenizer (GemmaTokenizer: BPE with byte
fallback, spaces as "▁", <bos> added), LTX2TextConnectors, LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video,
AutoencoderKLLTX2Audio, the vocoder and the flow-matching scheduler, written by `write_checkpoint`.

Two published layouts share the pipeline (scripts/convert_ltx2_to_diffusers.py in diffusers):
- LTX-2.3 ("tiny", "small"): gated attention, timestep-modulated cross-attention, perturbed self-attention for
  STG, connectors with one text projection per modality, LTX2VocoderWithBWE (16 kHz vocoder, bandwidth-extended to
  48 kHz);
- LTX-2.0 ("tiny-2.0", Lightricks/LTX-2): the transformer projects the captions itself, one text projection
  (after a masked mean/range norm per Gemma layer) feeds both connectors, STG perturbs nothing, LTX2Vocoder at
  24 kHz.
The preset tables below size every component; the layout tables give what differs between the two. The
"ltx-2-config" and "ltx-2.3-config" presets are the published configs with random bf16 weights (real_size.py).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import (
    latent_statistics,
    save_component,
    save_tokenizer,
    training_corpus,
    write_default_request,
    write_model_index,
)

# Each preset's layout and the sizes it uses ("tiny-2.0" is the tiny sizes in LTX-2.0's layout).
PRESET_LAYOUTS = {"tiny": "2.3", "small": "2.3", "tiny-2.0": "2.0"}
PRESET_SIZES = {"tiny": "tiny", "small": "small", "tiny-2.0": "tiny"}

# Gemma 3's language model (Gemma3TextConfig keys). LTX2Pipeline stacks every hidden state (the embeddings and each
# layer's output, num_hidden_layers + 1 of them), so the connectors' input is hidden_size * (layers + 1) wide. One
# sliding-window layer and one global layer as in the published pattern; the window is shorter than the 1024
# padded tokens, so it takes effect.
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "small": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=512,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
}
# Gemma-3-12B's rotary embeddings: theta 10k on the sliding-window layers, 1M scaled linearly by 8 on the global ones.
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}
# The SigLIP tower Gemma3ForConditionalGeneration builds (the pipeline never runs it): one layer, 2x2 patches of 14
# pixels pooled to 4 image tokens.
VISION_CONFIG: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
MM_TOKENS_PER_IMAGE = 4

# The locally trained Gemma tokenizer: (vocab_size, corpus_sentences, corpus_names), see
# families.init_model.training_corpus. Gemma's special tokens come first (<pad> 0, <eos> 1, <bos> 2, <unk> 3,
# <mask> 4, as in Gemma's vocabulary), then the chat and image markers, then the 256 byte-fallback pieces.
TOKENIZER_CONFIGS: dict[str, tuple[int, int, int]] = {"tiny": (2000, 6000, 2000), "small": (8000, 12000, 12000)}
GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
BYTE_PIECES = tuple(f"<0x{value:02X}>" for value in range(256))

# LTX2VideoTransformer3DModel sizes. Keys are the model's own config keys.
#   num_attention_heads / attention_head_dim              video stream (32 x 128 published)
#   audio_num_attention_heads / audio_attention_head_dim  audio stream (32 x 64 published); the audio-video
#       cross-attention's rotary embedding splits audio_cross_attention_dim over num_attention_heads, so both
#       streams have as many heads
#   cross_attention_dim / audio_cross_attention_dim       the text each stream attends to (its inner width)
#   num_layers                                            joint blocks (48 published)
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        audio_num_attention_heads=4,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=16,
        num_layers=2,
    ),
    "small": dict(
        num_attention_heads=8,
        attention_head_dim=16,
        cross_attention_dim=128,
        audio_num_attention_heads=8,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=64,
        num_layers=4,
    ),
}
# What the two published layouts set differently in the transformer.
TRANSFORMER_LAYOUTS: dict[str, dict[str, Any]] = {
    "2.0": dict(
        gated_attn=False,
        cross_attn_mod=False,
        audio_gated_attn=False,
        audio_cross_attn_mod=False,
        use_prompt_embeddings=True,
        perturbed_attn=False,
    ),
    "2.3": dict(
        gated_attn=True,
        cross_attn_mod=True,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        use_prompt_embeddings=False,
        perturbed_attn=True,
    ),
}

# LTX2TextConnectors: each connector's layers and learnable registers (128 registers published: they fill the
# padding, so the padded length must be a multiple of them), and in LTX-2.0 the width of a head (both connectors
# are as wide as Gemma's hidden size there: 30 x 128 = 3840 published). In LTX-2.3 each connector has the heads of
# the stream it feeds (32 x 128 video, 32 x 64 audio published).
CONNECTOR_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2, registers=128, head_dim_2_0=8),
    "small": dict(num_layers=2, registers=128, head_dim_2_0=16),
}

# AutoencoderKLLTX2Video: 4x4 pixel patches and three 2x spatio-temporal steps, 32x spatial and 8x temporal
# compression as published, narrower and one layer per block.
LATENT_CHANNELS = {"tiny": 8, "small": 32}
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(encoder=(8, 16, 32, 32), decoder_2_0=(8, 16, 32), decoder_2_3=(8, 16, 16, 32)),
    "small": dict(encoder=(16, 32, 64, 64), decoder_2_0=(16, 32, 64), decoder_2_3=(16, 32, 32, 64)),
}

# AutoencoderKLLTX2Audio: mel spectrograms at 16 kHz with a hop of 160 (100 frames a second) as published, 4x
# compressed in time and in mel bins. Its latent statistics hold one value per packed feature (latent channels x
# latent mel bins: 8 x 16 = 128 published), which the class sizes by base_channels, so base_channels is that product.
AUDIO_VAE_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(latent_channels=4, mel_bins=16),
    "small": dict(latent_channels=8, mel_bins=32),
}
AUDIO_SAMPLE_RATE, MEL_HOP_LENGTH = 16_000, 160

# The vocoders, narrower, with the published upsampling (each upsampler halves the channels).
#   LTX2Vocoder (2.0): 6*5*2*2*2 = 240 samples per mel frame, 24 kHz out;
#   LTX2VocoderWithBWE (2.3): 5*2^5 = 160 samples per mel frame (16 kHz), a mel STFT of that and a second vocoder
#   extending it to 48 kHz.
VOCODER_HIDDEN = {"tiny": 64, "small": 128}

# FlowMatchEulerDiscreteScheduler as the published (not distilled) checkpoints ship it: the shift computed per
# request from the video's token count, the sigmas stretched to end at 0.1.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)

# The request each preset is sized for (LTX2Pipeline keyword arguments): 64x96 pixels are 2x3 latents and 17
# frames 3 latent frames (18 audio latent frames at 24 fps); 256x384 are 8x12 latents, 33 frames 5 latent frames.
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=3.0),
    "small": dict(height=256, width=384, num_frames=33, num_inference_steps=8, guidance_scale=3.0),
}

# model_index.json entries as in the published LTX-2 diffusers checkpoints (the optional prompt enhancer,
# processor and duration head are absent there too).
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"),
    "connectors": ("ltx2", "LTX2TextConnectors"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Gemma3ForConditionalGeneration"),
    "tokenizer": ("transformers", "GemmaTokenizerFast"),
    "transformer": ("diffusers", "LTX2VideoTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLLTX2Video"),
}
VOCODER_CLASSES = {"2.0": ("ltx2", "LTX2Vocoder"), "2.3": ("ltx2", "LTX2VocoderWithBWE")}


def write_checkpoint(
    family: Family,
    out: Path,
    preset: str,
    seed: int,
    save_kwargs: dict[str, Any],
    components: Collection[str] | None = None,
) -> None:
    """Tokenizer, Gemma 3, connectors, transformer, both VAEs, vocoder, scheduler, model_index.json and defaults.
    A `*-config` preset is the published configs' (real_size.py), of which `components` writes a part."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if preset.endswith("-config"):
        from families.ltx2.real_size import write_real_size_checkpoint

        write_real_size_checkpoint(family, out, preset, seed, save_kwargs, components)
        return
    if components is not None:
        raise ValueError(f"{preset}: only a real-size preset is written in part")
    layout, size = PRESET_LAYOUTS[preset], PRESET_SIZES[preset]
    tokenizer = build_tokenizer(size)
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    text_encoder = build_text_encoder(size, tokenizer)
    save_component(text_encoder, out, "text_encoder", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_connectors(size, layout), out, "connectors", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_transformer(size, layout), out, "transformer", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vae(size, layout, seed), out, "vae", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_audio_vae(size, seed), out, "audio_vae", save_kwargs)
    torch.manual_seed(seed)
    save_component(build_vocoder(size, layout), out, "vocoder", save_kwargs)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")

    write_model_index(out, family, {**COMPONENT_CLASSES, "vocoder": VOCODER_CLASSES[layout]})
    write_default_request(out, family, DEFAULT_REQUESTS[size])


def build_tokenizer(size: str) -> Any:
    """A Gemma tokenizer trained on the built-in corpus, saved as GemmaTokenizer (what AutoTokenizer reloads for
    the published GemmaTokenizerFast): BPE with byte fallback over text whose spaces are "▁", <bos> prepended.

    The trainer splits words before each "▁" so that pieces start with it, as Gemma's do; GemmaTokenizer then
    applies the merges to the whole text, as it does with the published vocabulary.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    vocab_size, sentences, names = TOKENIZER_CONFIGS[size]
    trained = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*GEMMA_SPECIAL_TOKENS, *GEMMA_MARKERS, *BYTE_PIECES],
        show_progress=False,
    )
    trained.train_from_iterator(training_corpus(sentences, names), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    return GemmaTokenizer(
        vocab=model["vocab"],
        merges=merges,
        add_bos_token=True,
        add_eos_token=False,
        extra_special_tokens=list(GEMMA_MARKERS),
    )


def build_text_encoder(size: str, tokenizer: Any) -> torch.nn.Module:
    """The preset's Gemma3ForConditionalGeneration, its token ids matching `tokenizer`."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (*GEMMA_SPECIAL_TOKENS, *GEMMA_MARKERS)}
    text_config = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=131072,
        rope_parameters=GEMMA_ROPE,
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<eos>"],
        bos_token_id=ids["<bos>"],
        **TEXT_ENCODER_CONFIGS[size],
    )
    config = Gemma3Config(
        text_config=text_config,
        vision_config=dict(VISION_CONFIG),
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    return Gemma3ForConditionalGeneration(config).eval()


def build_connectors(size: str, layout: str) -> torch.nn.Module:
    """The preset's LTX2TextConnectors over every Gemma hidden state, in `layout`."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    gemma, transformer, sizes = TEXT_ENCODER_CONFIGS[size], TRANSFORMER_CONFIGS[size], CONNECTOR_SIZES[size]
    hidden = gemma["hidden_size"]
    if layout == "2.0":
        # Both connectors as wide as Gemma; the transformer's caption projections take them to each stream's width.
        video_head_dim = audio_head_dim = sizes["head_dim_2_0"]
        video_heads = audio_heads = hidden // sizes["head_dim_2_0"]
        widths: dict[str, Any] = dict(per_modality_projections=False, proj_bias=False)
    else:
        video_heads, video_head_dim = transformer["num_attention_heads"], transformer["attention_head_dim"]
        audio_heads, audio_head_dim = transformer["audio_num_attention_heads"], transformer["audio_attention_head_dim"]
        widths = dict(
            per_modality_projections=True,
            video_hidden_dim=video_heads * video_head_dim,
            audio_hidden_dim=audio_heads * audio_head_dim,
            proj_bias=True,
        )
    gated = layout == "2.3"
    return LTX2TextConnectors(
        caption_channels=hidden,
        text_proj_in_factor=gemma["num_hidden_layers"] + 1,
        video_connector_num_attention_heads=video_heads,
        video_connector_attention_head_dim=video_head_dim,
        video_connector_num_layers=sizes["num_layers"],
        video_connector_num_learnable_registers=sizes["registers"],
        video_gated_attn=gated,
        audio_connector_num_attention_heads=audio_heads,
        audio_connector_attention_head_dim=audio_head_dim,
        audio_connector_num_layers=sizes["num_layers"],
        audio_connector_num_learnable_registers=sizes["registers"],
        audio_gated_attn=gated,
        connector_rope_base_seq_len=4096,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_temporal_positioning=False,
        rope_type="split",
        **widths,
    ).eval()


def build_transformer(size: str, layout: str) -> torch.nn.Module:
    """The preset's LTX2VideoTransformer3DModel in `layout`, freshly initialised."""
    from diffusers import LTX2VideoTransformer3DModel

    audio = AUDIO_VAE_SIZES[size]
    audio_features = audio["latent_channels"] * audio["mel_bins"] // 4
    return LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS[size],
        out_channels=LATENT_CHANNELS[size],
        patch_size=1,
        patch_size_t=1,
        vae_scale_factors=(8, 32, 32),
        audio_in_channels=audio_features,
        audio_out_channels=audio_features,
        audio_sampling_rate=AUDIO_SAMPLE_RATE,
        audio_hop_length=MEL_HOP_LENGTH,
        caption_channels=TEXT_ENCODER_CONFIGS[size]["hidden_size"],
        rope_type="split",
        rope_double_precision=True,
        **TRANSFORMER_CONFIGS[size],
        **TRANSFORMER_LAYOUTS[layout],
    ).eval()


def build_vae(size: str, layout: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLLTX2Video (LTX-2.0's or LTX-2.3's decoder), latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLLTX2Video

    widths, channels = VAE_CONFIGS[size], LATENT_CHANNELS[size]
    if layout == "2.0":
        decoder: dict[str, Any] = dict(
            decoder_block_out_channels=widths["decoder_2_0"],
            decoder_layers_per_block=(1, 1, 1, 1),
            decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False, False, False, False),
            upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
            upsample_residual=(True, True, True),
            upsample_factor=(2, 2, 2),
            decoder_spatial_padding_mode="reflect",
        )
    else:
        decoder = dict(
            decoder_block_out_channels=widths["decoder_2_3"],
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            decoder_spatio_temporal_scaling=(True, True, True, True),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
            upsample_residual=(False, False, False, False),
            upsample_factor=(2, 2, 1, 2),
            decoder_spatial_padding_mode="zeros",
        )
    vae = AutoencoderKLLTX2Video(
        latent_channels=channels,
        block_out_channels=widths["encoder"],
        layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
        **decoder,
    ).eval()
    _draw_statistics(vae, channels, seed)
    return vae


def build_audio_vae(size: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLLTX2Audio, its statistics over packed features drawn from `seed`."""
    from diffusers import AutoencoderKLLTX2Audio

    sizes = AUDIO_VAE_SIZES[size]
    features = sizes["latent_channels"] * sizes["mel_bins"] // 4
    vae = AutoencoderKLLTX2Audio(
        base_channels=features,
        output_channels=2,
        ch_mult=(1, 2, 4),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=sizes["latent_channels"],
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=AUDIO_SAMPLE_RATE,
        mel_hop_length=MEL_HOP_LENGTH,
        is_causal=True,
        mel_bins=sizes["mel_bins"],
        double_z=True,
    ).eval()
    _draw_statistics(vae, features, seed + 1)
    return vae


def build_vocoder(size: str, layout: str) -> torch.nn.Module:
    """The preset's vocoder: LTX2Vocoder (2.0) or LTX2VocoderWithBWE (2.3), taking both mel channels."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    mel_bins, hidden = AUDIO_VAE_SIZES[size]["mel_bins"], VOCODER_HIDDEN[size]
    if layout == "2.0":
        return LTX2Vocoder(
            in_channels=2 * mel_bins,
            hidden_channels=hidden,
            out_channels=2,
            upsample_kernel_sizes=[16, 15, 8, 4, 4],
            upsample_factors=[6, 5, 2, 2, 2],
            resnet_kernel_sizes=[3, 7],
            resnet_dilations=[[1, 3, 5], [1, 3, 5]],
            act_fn="leaky_relu",
            final_act_fn="tanh",
            final_bias=True,
            output_sampling_rate=24_000,
        ).eval()
    return LTX2VocoderWithBWE(
        in_channels=2 * mel_bins,
        hidden_channels=2 * hidden,
        out_channels=2,
        upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
        upsample_factors=[5, 2, 2, 2, 2, 2],
        resnet_kernel_sizes=[3, 7],
        resnet_dilations=[[1, 3, 5], [1, 3, 5]],
        bwe_in_channels=2 * mel_bins,
        bwe_hidden_channels=hidden,
        bwe_out_channels=2,
        bwe_upsample_kernel_sizes=[12, 11, 4, 4, 4],
        bwe_upsample_factors=[6, 5, 2, 2, 2],
        bwe_resnet_kernel_sizes=[3, 7],
        bwe_resnet_dilations=[[1, 3, 5], [1, 3, 5]],
        num_mel_channels=mel_bins,
        input_sampling_rate=AUDIO_SAMPLE_RATE,
        output_sampling_rate=48_000,
    ).eval()


def _draw_statistics(vae: torch.nn.Module, features: int, seed: int) -> None:
    """Sets a VAE's latents_mean / latents_std buffers to statistics drawn from `seed` (the classes start them at 0
    and 1), so that the pipeline's normalisation of latents is exercised with non-trivial values."""
    mean, std = latent_statistics(features, seed)
    vae.latents_mean.copy_(torch.tensor(mean))
    vae.latents_std.copy_(torch.tensor(std))
