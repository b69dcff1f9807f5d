"""Random-weight Wan checkpoints in the published diffusers layout (`stagediff init-model --family wan-t2v`).

  wan-t2v       Wan2.1 text-to-video: one WanTransformer3DModel
  wan2.2-a14b   Wan2.2-T2V-A14B: two WanTransformer3DModel experts (`transformer` for high noise,
                `transformer_2` for low noise) and the pipeline config entry `boundary_ratio`

Both are written by `write_checkpoint`, which reads the difference from the Family it is given: a family
that requires the `transformer_2` component gets the second expert, and one that requires the
`boundary_ratio` config entry gets that entry. The preset tables below size every component.

wan-t2v also declares the preset "wan2.1-1.3b-config" (`Family.own_presets`): the configs and shard layout of
the published Wan2.1-T2V-1.3B-Diffusers checkpoint with random bf16 weights, about 7B parameters (a 5.7B
UMT5-XXL encoder, a 1.3B transformer), so that memory, load times and startup are measured at real size.
It is written by `write_real_size_checkpoint`: each module is built on the meta device, materialised in bf16
and filled tensor by tensor, so no float32 copy of anything is ever held.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from families.base import Family
from families.init_model import (
    save_component,
    save_tokenizer,
    training_corpus,
    vae_with_latent_statistics,
    write_default_request,
    write_model_index,
)

# WanTransformer3DModel (the DiT). Keys are the model's own config keys.
#   patch_size          (t, h, w) patch over the latent video; (1, 2, 2) as in every Wan2.1 model
#   num_attention_heads heads per attention; divisible by 2 and 4 so Ulysses/tensor parallelism can split them
#   attention_head_dim  width of one head; hidden size = heads * head_dim
#   in/out_channels     latent channels, equal to the VAE's z_dim
#   text_dim            width of the text embeddings, equal to the text encoder's d_model
#   freq_dim            sinusoidal timestep embedding width (256 in the real models)
#   ffn_dim             hidden width of each block's feed-forward
#   num_layers          number of transformer blocks
#   cross_attn_norm     layer-norm before cross-attention, as in the real models
#   qk_norm             RMS norm of queries and keys across all heads, as in the real models
#   rope_max_seq_len    longest positional extent (frames, rows, columns of patches) RoPE covers (1024 as in
#                       the real models; its tables are not saved weights)
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
    "small": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=48,
        in_channels=16,
        out_channels=16,
        text_dim=128,
        freq_dim=256,
        ffn_dim=1536,
        num_layers=12,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
}

# AutoencoderKLWan (the causal 3D VAE). Keys are the model's own config keys.
#   base_dim            channels of the first encoder stage (96 in the real model)
#   z_dim               latent channels
#   dim_mult            channel multiplier per resolution stage
#   num_res_blocks      residual blocks per stage
#   attn_scales         resolutions with spatial attention (none, as in the real model)
#   temperal_downsample which of the three downsamplings also halve time (4x overall, as in the real model)
# latents_mean / latents_std are not fixed here: they are drawn from the seed (families.init_model).
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
    "small": dict(
        base_dim=24,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
}

# UMT5EncoderModel (the text encoder); UMT5Config keys. vocab_size is not set here: it is the size of
# the tokenizer trained for the checkpoint, so every token id has an embedding row.
#   d_model                 hidden width (= the transformer's text_dim)
#   d_kv                    width of one attention head
#   d_ff                    feed-forward hidden width
#   num_layers / num_heads  encoder depth and heads
#   relative_attention_*    T5 relative position buckets
#   feed_forward_proj       gated GELU feed-forward, as in UMT5
#   pad/eos/decoder_start   token ids matching the tokenizer (<pad>=0, </s>=1)
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
    "small": dict(
        d_model=128,
        d_kv=32,
        d_ff=256,
        num_layers=4,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
}

# The locally trained Unigram tokenizer (the corpus and these keys: families.init_model.training_corpus).
# The trainer keeps only pieces that win some segmentation of the corpus, so a larger vocabulary needs a
# more varied corpus (more made-up names).
TOKENIZER_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": dict(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# UniPCMultistepScheduler configured as in the published Wan2.1 diffusers checkpoints.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

# The request each preset is sized for: WanPipeline keyword arguments. Measured end to end through
# WanPipeline (CFG doubles the transformer calls), best of several runs on a shared 2-core CPU:
#   tiny,  1 thread:  ~0.15 s (transformer ~0.01 s, VAE decode ~0.1 s, text encoder ~0.04 s)
#   small, 2 threads: ~19 s   (transformer 12-13 s = 65-70%, VAE decode ~6 s = 30-33%, text encoder 0.05 s)
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0),
    "small": dict(height=256, width=256, num_frames=17, num_inference_steps=8, guidance_scale=5.0),
}

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5/UMT5

# model_index.json entries. The published Wan2.1 checkpoints name T5TokenizerFast, but in transformers 5
# T5Tokenizer (= T5TokenizerFast) rebuilds its normaliser and pre-tokeniser on load and so would drop
# ours; the generic tokenizers-backed class, which AutoTokenizer resolves for what we save, loads
# tokenizer.json exactly as written.
COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "UniPCMultistepScheduler"),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "TokenizersBackend"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}

# Wan2.2-T2V-A14B: `transformer` denoises while t >= boundary_ratio * num_train_timesteps, `transformer_2`
# after that (0.875 as in the published checkpoint). The second expert's weights are drawn from seed + this.
A14B_BOUNDARY_RATIO = 0.875
SECOND_EXPERT_SEED_OFFSET = 1


def write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Tokenizer, UMT5 text encoder, transformer(s), VAE, scheduler, model_index.json and defaults file.

    model_index.json is as in the published Wan2.1 (or, with two experts, Wan2.2-T2V-A14B) diffusers
    checkpoints. WanPipeline registers `boundary_ratio` and `expand_timesteps` as pipeline config entries,
    so they sit next to the components in model_index.json.
    """
    if preset == REAL_SIZE_PRESET:
        write_real_size_checkpoint(family, out, seed, save_kwargs)
        return
    tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
    save_tokenizer(tokenizer, out)

    torch.manual_seed(seed)
    save_component(build_text_encoder(preset, vocab_size=len(tokenizer)), out, "text_encoder", save_kwargs)

    torch.manual_seed(seed)
    save_component(build_transformer(preset), out, "transformer", save_kwargs)
    components = dict(COMPONENT_CLASSES)
    if "transformer_2" in family.requires:
        # The low-noise expert gets its own seed, so the two experts differ and a switch at the wrong
        # step shows in the output.
        torch.manual_seed(seed + SECOND_EXPERT_SEED_OFFSET)
        save_component(build_transformer(preset), out, "transformer_2", save_kwargs)
        components["transformer_2"] = COMPONENT_CLASSES["transformer"]

    torch.manual_seed(seed)
    save_component(build_vae(preset, seed), out, "vae", save_kwargs)

    build_scheduler().save_pretrained(out / "scheduler")

    entries: dict[str, Any] = {}
    if "boundary_ratio" in family.requires:
        entries.update(boundary_ratio=A14B_BOUNDARY_RATIO, expand_timesteps=False)
    write_model_index(out, family, components, **entries)
    write_default_request(out, family, DEFAULT_REQUESTS[preset])


# ---------------------------------------------------------------------------------------------
# "wan2.1-1.3b-config": Wan-AI/Wan2.1-T2V-1.3B-Diffusers' configs with random weights.

REAL_SIZE_PRESET = "wan2.1-1.3b-config"

# transformer/config.json of Wan2.1-T2V-1.3B-Diffusers (hidden size 12 x 128 = 1536, 30 blocks).
REAL_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

# text_encoder/config.json: google/umt5-xxl's encoder, with its real vocabulary (256384 embedding rows), so
# that the parameter count (5.7B) and bytes are the real ones. The locally trained tokenizer uses the first
# rows only.
REAL_TEXT_ENCODER_CONFIG: dict[str, Any] = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_decoder_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
    layer_norm_epsilon=1e-6,
    dropout_rate=0.1,
    classifier_dropout=0.0,
    initializer_factor=1.0,
    scalable_attention=True,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

# vae/config.json: Wan2.1's VAE with its published per-channel latent statistics (they are also diffusers'
# AutoencoderKLWan defaults).
REAL_VAE_CONFIG: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    latents_std=[
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
    ],
)  # fmt: skip

# The published checkpoint is float32 with shards of at most 5 GB: 5 text encoder shards, 2 transformer
# shards, one VAE file. Half that limit in bf16 splits the same tensors into the same shards.
REAL_SIZE_SHARD_BYTES = 2_500_000_000
REAL_SIZE_DTYPE = torch.bfloat16
# Random weights are normal(0, REAL_SIZE_WEIGHT_STD); norm scales are 1.
REAL_SIZE_WEIGHT_STD = 0.02


def write_real_size_checkpoint(family: Family, out: Path, seed: int, save_kwargs: dict[str, Any]) -> None:
    """The "wan2.1-1.3b-config" checkpoint: published configs and shard layout, random bf16 weights.

    One component at a time is built on the meta device, materialised in bf16, filled and saved, then
    dropped; the largest (the 11.4 GB text encoder) is the peak. The tokenizer is the "small" preset's
    locally trained one. No defaults file is written: like a downloaded checkpoint, it gets the family's
    reference request defaults.
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    save_kwargs = {"max_shard_size": REAL_SIZE_SHARD_BYTES, **save_kwargs}
    save_tokenizer(build_tokenizer(**TOKENIZER_CONFIGS["small"]), out)

    with torch.device("meta"):
        text_encoder = UMT5EncoderModel(UMT5Config(**REAL_TEXT_ENCODER_CONFIG))
    save_component(random_bf16(text_encoder, seed).eval(), out, "text_encoder", save_kwargs)
    del text_encoder

    with torch.device("meta"):
        transformer = WanTransformer3DModel(**REAL_TRANSFORMER_CONFIG)
    save_component(random_bf16(transformer, seed).eval(), out, "transformer", save_kwargs)
    del transformer

    with torch.device("meta"):
        vae = AutoencoderKLWan(**REAL_VAE_CONFIG)
    save_component(random_bf16(vae, seed).eval(), out, "vae", save_kwargs)
    del vae

    build_scheduler().save_pretrained(out / "scheduler")
    write_model_index(out, family, dict(COMPONENT_CLASSES))


def random_bf16(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` (built on the meta device) materialised in bf16 on the CPU with seeded random weights.

    Every saved tensor is filled in place, in state-dict order, from one generator seeded with `seed`:
    normal(0, REAL_SIZE_WEIGHT_STD), except the scales of norms (the VAE's RMS-norm `gamma`s, and the
    one-dimensional weights of modules named "norm"), which are 1. A tensor shared under two names (UMT5's
    embedding) is filled once. Buffers that are not saved (Wan's RoPE tables) are left unset: loaders
    compute them.
    """
    model = model.to(REAL_SIZE_DTYPE).to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        # to_empty gives each module a parameter of its own: tie UMT5's embedding to the encoder's again, so
        # that it is filled and saved once, as in the published checkpoint.
        model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    filled: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: a saved {tensor.dtype} tensor; only floating-point weights are filled")
            if tensor.data_ptr() in filled:
                continue
            filled.add(tensor.data_ptr())
            if name.endswith(".gamma") or (tensor.dim() == 1 and "norm" in name and name.endswith("weight")):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, REAL_SIZE_WEIGHT_STD, generator=generator)
    return model


def build_transformer(preset: str) -> torch.nn.Module:
    """The preset's WanTransformer3DModel with freshly initialised weights."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TRANSFORMER_CONFIGS[preset]).eval()


def build_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLWan, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLWan

    return vae_with_latent_statistics(AutoencoderKLWan, VAE_CONFIGS[preset], seed)


def build_text_encoder(preset: str, vocab_size: int) -> torch.nn.Module:
    """The preset's UMT5EncoderModel, with one embedding row per tokenizer token."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, **TEXT_ENCODER_CONFIGS[preset])
    return UMT5EncoderModel(config).eval()


def build_scheduler() -> Any:
    """The flow-matching UniPC scheduler Wan2.1 ships with."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**SCHEDULER_CONFIG)


def build_tokenizer(vocab_size: int, corpus_sentences: int, corpus_names: int, extra_lines: Sequence[str] = ()) -> Any:
    """A T5-style (sentencepiece Unigram) tokenizer trained on the built-in corpus and `extra_lines`.

    Like UMT5's: <pad>=0, </s>=1, <unk>=2; NFKC normalisation with runs of whitespace collapsed;
    Metaspace pre-tokenisation ("▁" marks a word start); "</s>" appended to every sequence.
    It depends only on its arguments, not on any seed: a preset always gets the same tokenizer.
    """
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token="<unk>",
        # Every printable ASCII character gets a piece, so plain English text never maps to <unk>.
        initial_alphabet=[c for c in string.printable if not c.isspace()],
        max_piece_length=16,
        show_progress=False,
    )
    trained = _with_t5_pipeline(Tokenizer(models.Unigram()))
    corpus = [*training_corpus(corpus_sentences, corpus_names), *extra_lines]
    trained.train_from_iterator(corpus, trainer=trainer)
    vocab = _canonical_vocab(json.loads(trained.to_str())["model"]["vocab"])

    unk_id = SPECIAL_TOKENS.index("<unk>")
    tokenizer = _with_t5_pipeline(Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False)))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    # In transformers 5 PreTrainedTokenizerFast is TokenizersBackend, the name saved and resolved.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1_000_000,  # effectively unlimited, as UMT5's: the pipeline truncates itself
        padding_side="right",
    )


def _with_t5_pipeline(tokenizer: Any) -> Any:
    """Attach T5's normaliser, pre-tokeniser, decoder and "$A </s>" post-processor to `tokenizer`."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    eos_id = SPECIAL_TOKENS.index("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return tokenizer


def _canonical_vocab(vocab: list[list[Any]]) -> list[tuple[str, float]]:
    """The trained Unigram vocabulary in a run-independent order.

    The trainer gives characters that never won a segmentation a score just above the lowest one,
    0.0001 apart in hash-set order, which differs from run to run. Give them all the lowest score,
    round away summation noise, and break ties by the piece itself.
    """
    specials = [(str(piece), 0.0) for piece, _ in vocab[: len(SPECIAL_TOKENS)]]
    if [piece for piece, _ in specials] != list(SPECIAL_TOKENS):
        raise RuntimeError(f"special tokens came out as {specials}, expected {SPECIAL_TOKENS} first")
    learned = [(str(piece), float(score)) for piece, score in vocab[len(SPECIAL_TOKENS) :]]
    lowest = min(score for _, score in learned)
    band = lowest + 1e-4 * (sum(len(piece) == 1 for piece, _ in learned) + 1)
    learned = [(piece, lowest if len(piece) == 1 and score <= band else score) for piece, score in learned]
    learned = sorted(((piece, round(score, 6)) for piece, score in learned), key=lambda ps: (-ps[1], ps[0]))
    return specials + learned
