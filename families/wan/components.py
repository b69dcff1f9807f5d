"""Building the Wan components of a preset with fresh weights: transformer, VAE, UMT5 text encoder, scheduler,
and the T5-style tokenizer trained locally (it depends only on its arguments, never on a seed).
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from typing import Any

import torch

from families.init_model import training_corpus, vae_with_latent_statistics
from families.wan.presets import (
    SCHEDULER_CONFIG,
    SPECIAL_TOKENS,
    TEXT_ENCODER_CONFIGS,
    TRANSFORMER_CONFIGS,
    VAE_CONFIGS,
)


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
