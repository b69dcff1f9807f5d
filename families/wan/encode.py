"""Prompt encoding exactly as WanPipeline does it: UMT5, zero past each text, padded to a fixed length."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5EncoderModel

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained


class WanPromptEncoder(PromptEncoder):
    """UMT5 prompt encoder with WanPipeline's tokenization, truncation and zero padding."""

    def __init__(
        self,
        model_dir: str | Path,
        model_id: str,
        device: torch.device,
        dtype: torch.dtype,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        load_threads: int = 4,
    ) -> None:
        model_dir = Path(model_dir)
        text_encoder = load_pretrained(
            UMT5EncoderModel, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        super().__init__(model_id, device, tokenizer, text_encoder, cache_bytes, cache_entries)

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.d_model

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """The [max_sequence_length, dim] embedding of one text: zero past the text, as WanPipeline makes it."""
        return self.embed_many([text], max_sequence_length)[0]

    def embed_many(self, texts: list[str], max_sequence_length: int, pad_to_longest: bool = False) -> torch.Tensor:
        """[N, max_sequence_length, dim]: each text as `embed_uncached` embeds it, in one batch.

        With `pad_to_longest` the encoder runs on the longest text's length only, and the result is
        [N, longest, dim]: the same values (the encoder masks padding out), for much less work on short texts.
        """
        inputs = self.tokenizer(
            [prompt_clean(text) for text in texts],
            padding="longest" if pad_to_longest else "max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask.to(self.device)).last_hidden_state
        return (hidden * mask.to(hidden.device, hidden.dtype).unsqueeze(-1)).cpu()

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """The text's tokens (its end token included) beyond `max_sequence_length`, which `embed_many` cuts."""
        # verbose=False: no warning that the text is longer than the tokenizer's model_max_length.
        count = len(self.tokenizer(prompt_clean(text), add_special_tokens=True, verbose=False).input_ids)
        return Truncation(given=count, kept=max_sequence_length) if count > max_sequence_length else None

    def batch(self, embeddings: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"embeds": [N, max_sequence_length, dim]}: every text has the same length."""
        return {"embeds": torch.stack(embeddings)}
