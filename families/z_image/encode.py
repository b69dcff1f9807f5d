"""Prompt encoding exactly as ZImagePipeline.encode_prompt does it.

Z-Image conditions on Qwen3's second-to-last hidden state over the prompt put in the tokenizer's chat template
(one user message, the generation prompt added, thinking enabled: the template's own text around the prompt).
The pipeline pads every text to `max_sequence_length` tokens, cuts it there, runs the encoder over the padded
batch with its attention mask and keeps the attended positions only: each text has its own length, template
included. The stage sends them zero-padded to the longest text of the request with their mask ("embeds",
"embeds_mask", as Qwen-Image's), and the DiT drops the padding again (families/z_image/denoise.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Model

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained


class ZImagePromptEncoder(PromptEncoder):
    """Qwen3 prompt encoder with ZImagePipeline's chat template, padding, truncation and hidden layer."""

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
        # Qwen3Model, the class the published checkpoints' model_index.json names.
        text_encoder = load_pretrained(
            Qwen3Model, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        # The tokenizer as transformers types it: its chat template is what the prompt is put in.
        self.chat_tokenizer = tokenizer
        super().__init__(model_id, device, tokenizer, text_encoder, cache_bytes, cache_entries)

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.hidden_size

    def templated(self, text: str) -> str:
        """The text in the chat template, as ZImagePipeline._encode_prompt fills it."""
        messages = [{"role": "user", "content": text}]
        return self.chat_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
        )

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """The [L, dim] embedding of one text: its attended positions, L <= max_sequence_length."""
        tokens = self.tokenizer(
            [self.templated(text)],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(
            input_ids=tokens.input_ids.to(self.device), attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        # A copy of its own, so that the cache holds (and counts) these rows only.
        return hidden[0][mask[0]].to(self.text_encoder.dtype).cpu().clone()

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """The templated text's tokens beyond the `max_sequence_length` the pipeline keeps."""
        count = len(self.tokenizer([self.templated(text)], verbose=False).input_ids[0])
        return Truncation(given=count, kept=max_sequence_length) if count > max_sequence_length else None

    def batch(self, embeddings: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"embeds": [N, L, dim] zero-padded to the longest text, "embeds_mask": [N, L] (int64, 1 = token)}."""
        longest = max(embedding.shape[0] for embedding in embeddings)
        embeds = torch.zeros(len(embeddings), longest, self.hidden_size, dtype=embeddings[0].dtype)
        mask = torch.zeros(len(embeddings), longest, dtype=torch.long)
        for i, embedding in enumerate(embeddings):
            embeds[i, : embedding.shape[0]] = embedding
            mask[i, : embedding.shape[0]] = 1
        return {"embeds": embeds, "embeds_mask": mask}
