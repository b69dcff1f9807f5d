"""Prompt encoding exactly as FluxPipeline.encode_prompt does it: CLIP's pooled vector and T5's sequence.

FLUX conditions on two text encoders run over the same text. CLIP (`text_encoder`, `tokenizer`) is padded and
truncated to its 77 tokens and gives one pooled vector, the transformer's `pooled_projections`; T5
(`text_encoder_2`, `tokenizer_2`) is padded and truncated to `max_sequence_length` and gives the sequence, its
`encoder_hidden_states`. Both are one stage: they read the same text, and the pooled vector is a few kilobytes
beside T5's sequence. FLUX attends to every T5 position, padding included (FluxPipeline sends no mask), so the
sequence always has `max_sequence_length` rows.

The stage sends, per text, "embeds" [1, L, 4096] and "pooled_embeds" [1, 768], which travel as
"prompt_embeds" and "prompt_pooled_embeds" (and "negative_..." for the negative prompt).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained

# FluxPipeline.tokenizer_max_length when the CLIP tokenizer does not say (it does: model_max_length).
CLIP_MAX_LENGTH = 77


class FluxPromptEncoder(PromptEncoder):
    """CLIP + T5 prompt encoder with FluxPipeline's padding and truncation."""

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
        self.clip = load_pretrained(
            CLIPTextModel, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.clip_tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        t5 = load_pretrained(
            T5EncoderModel, model_dir / "text_encoder_2", device=device, dtype=dtype, num_threads=load_threads
        )
        t5_tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer_2")
        super().__init__(model_id, device, t5_tokenizer, t5, cache_bytes, cache_entries)
        self.clip_max_length = getattr(self.clip_tokenizer, "model_max_length", CLIP_MAX_LENGTH)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.clip, "text_encoder_2": self.text_encoder}

    def embed_uncached(self, text: str, max_sequence_length: int) -> dict[str, torch.Tensor]:
        """{"embeds": [max_sequence_length, dim] (T5), "pooled_embeds": [pooled_dim] (CLIP)} of one text."""
        clip_ids = self.clip_tokenizer(
            [text], padding="max_length", max_length=self.clip_max_length, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer(
            [text], padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids
        embeds = self.text_encoder(t5_ids.to(self.device), output_hidden_states=False)[0]
        return {
            "embeds": embeds[0].to(self.text_encoder.dtype).cpu(),
            "pooled_embeds": pooled[0].to(self.clip.dtype).cpu(),
        }

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """T5's cut at `max_sequence_length` (its end token counted), the sequence the image follows; CLIP's cut at
        77 tokens, which FluxPipeline also makes, is reported only when T5 keeps the whole text."""
        count = len(self.tokenizer([text], verbose=False).input_ids[0])
        if count > max_sequence_length:
            return Truncation(given=count, kept=max_sequence_length)
        clip_count = len(self.clip_tokenizer([text], verbose=False).input_ids[0])
        if clip_count > self.clip_max_length:
            return Truncation(given=clip_count, kept=self.clip_max_length, encoder="CLIP")
        return None

    def batch(self, embeddings: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """{"embeds": [N, max_sequence_length, dim], "pooled_embeds": [N, pooled_dim]}."""
        return {name: torch.stack([embedding[name] for embedding in embeddings]) for name in embeddings[0]}
