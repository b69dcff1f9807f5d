"""Prompt encoding exactly as Flux2KleinPipeline.encode_prompt does it: stacked Qwen3 hidden states.

The prompt is put in a chat as the user's message and rendered by the tokenizer's own chat template with the
generation prompt and thinking off (`enable_thinking=False`), then padded and truncated to
`max_sequence_length` tokens. Qwen3 (`Qwen3ForCausalLM`) runs over it with the attention mask, and the hidden
states after layers 9, 18 and 27 (the pipeline's `text_encoder_out_layers`; index 0 is the embeddings) are stacked
side by side per token: [L, 3 * hidden_size], the transformer's `joint_attention_dim`. The transformer attends to
every position, padding included (the pipeline sends it no mask), so the sequence always has
`max_sequence_length` rows, and the text's position ids are made by the DiT (denoise.py).

The stage sends, per text, "embeds" [1, L, 3 * hidden_size], which travels as "prompt_embeds" (and
"negative_prompt_embeds" for the negative prompt).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained

# Flux2KleinPipeline's text_encoder_out_layers: the hidden states it stacks, by index into `hidden_states`.
HIDDEN_STATES_LAYERS = (9, 18, 27)


def render_chat(tokenizer: Any, text: str) -> str:
    """The tokenizer's chat template over one user message, with the generation prompt and thinking off."""
    messages = [{"role": "user", "content": text}]
    return str(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    )


class Flux2KleinPromptEncoder(PromptEncoder):
    """Qwen3 prompt encoder with Flux2KleinPipeline's chat template, padding, truncation and stacked layers."""

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
            Qwen3ForCausalLM, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        layers = text_encoder.config.num_hidden_layers
        if max(HIDDEN_STATES_LAYERS) > layers:
            raise ValueError(
                f"{model_dir / 'text_encoder'}: Flux2KleinPipeline stacks the hidden states of layers "
                f"{HIDDEN_STATES_LAYERS}, but this Qwen3 has {layers} layers"
            )
        super().__init__(model_id, device, tokenizer, text_encoder, cache_bytes, cache_entries)

    def chat(self, text: str) -> str:
        """The text as the pipeline gives it to the tokenizer: the chat template's rendering of one user message."""
        return render_chat(self.tokenizer, text)

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """The [max_sequence_length, 3 * hidden_size] embedding of one text, as the pipeline makes it alone."""
        tokens = self.tokenizer(
            [self.chat(text)],
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=max_sequence_length,
        ).to(self.device)
        output = self.text_encoder(
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        stacked = torch.stack([output.hidden_states[layer][0] for layer in HIDDEN_STATES_LAYERS], dim=1)
        # [L, layers, hidden] -> [L, layers * hidden]: each token's layers side by side, as the pipeline's permute.
        return stacked.flatten(1).to(self.text_encoder.dtype).cpu()

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """The chat-rendered text's tokens (the template's included) beyond `max_sequence_length`."""
        count = len(self.tokenizer([self.chat(text)], verbose=False).input_ids[0])
        return Truncation(given=count, kept=max_sequence_length) if count > max_sequence_length else None

    def batch(self, embeddings: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"embeds": [N, max_sequence_length, 3 * hidden_size]}: every text has the same length."""
        return {"embeds": torch.stack(embeddings)}
