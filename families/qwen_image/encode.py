"""Prompt encoding exactly as QwenImagePipeline.encode_prompt does it.

Qwen-Image conditions on the last hidden state of Qwen2.5-VL's language model run over the prompt filled
into a chat template; the template's first `drop_idx` tokens (the system message) are dropped. Unlike
Wan's UMT5 embeddings, which are zero-padded to a fixed 512 tokens, these have the prompt's own length,
and the DiT must know which positions are real: the result is the embeddings zero-padded to the longest
text plus their attention mask (1 for a token, 0 for padding), the pipeline's `prompt_embeds_mask`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained

# QwenImagePipeline's prompt template and prompt_template_encode_start_idx.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP_IDX = 34
# QwenImagePipeline.tokenizer_max_length: the prompt is truncated to this many tokens after the template.
TOKENIZER_MAX_LENGTH = 1024


class QwenPromptEncoder(PromptEncoder):
    """Qwen2.5-VL prompt encoder with QwenImagePipeline's template, drop_idx and truncation."""

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
            Qwen2_5_VLForConditionalGeneration,
            model_dir / "text_encoder",
            device=device,
            dtype=dtype,
            num_threads=load_threads,
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        super().__init__(model_id, device, tokenizer, text_encoder, cache_bytes, cache_entries)

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.text_config.hidden_size

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """The [L, dim] embedding of one text (L <= max_sequence_length).

        One text per batch, as QwenImagePipeline encodes prompt and negative prompt in separate calls:
        with a batch of one there is no padding, so the numbers match the pipeline's exactly.
        """
        tokens = self.tokenizer(
            [PROMPT_TEMPLATE.format(text)],
            max_length=TOKENIZER_MAX_LENGTH + DROP_IDX,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        output = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden = output.hidden_states[-1][0]
        # _extract_masked_hidden for a batch of one: keep the attended positions, then drop the template.
        hidden = hidden[tokens.attention_mask[0].bool()][DROP_IDX:]
        # A copy of its own, so that the cache holds (and counts) these rows only, not the template's and
        # the truncated ones that share the view's storage.
        return hidden[:max_sequence_length].to(self.text_encoder.dtype).cpu().clone()

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """The text's tokens after the template's system message (the template's closing tokens included)
        beyond the TOKENIZER_MAX_LENGTH and `max_sequence_length` that `embed_uncached` keeps."""
        tokens = self.tokenizer([PROMPT_TEMPLATE.format(text)], verbose=False).input_ids[0]
        count, kept = len(tokens) - DROP_IDX, min(TOKENIZER_MAX_LENGTH, max_sequence_length)
        return Truncation(given=count, kept=kept) if count > kept else None

    def batch(self, embeddings: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"embeds": [N, L, dim] zero-padded to the longest text, "embeds_mask": [N, L] (int64, 1 = token)}."""
        longest = max(embedding.shape[0] for embedding in embeddings)
        embeds = torch.zeros(len(embeddings), longest, self.hidden_size, dtype=embeddings[0].dtype)
        mask = torch.zeros(len(embeddings), longest, dtype=torch.long)
        for i, embedding in enumerate(embeddings):
            embeds[i, : embedding.shape[0]] = embedding
            mask[i, : embedding.shape[0]] = 1
        return {"embeds": embeds, "embeds_mask": mask}
