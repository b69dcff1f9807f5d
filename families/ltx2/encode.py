"""Prompt encoding exactly as LTX2Pipeline computes it: Gemma 3's hidden states through LTX2TextConnectors.

LTX2Pipeline.encode_prompt (`_get_gemma_prompt_embeds`) tokenizes the stripped text with <bos>, padded on the left
to `max_sequence_length` tokens (1024) and cut there, runs Gemma 3 over it and stacks every hidden state (the
embeddings and each layer's output) into one [1, L, hidden * (layers + 1)] tensor. Its __call__ then runs the
connectors on that with the attention mask and the tokenizer's padding side ("left"), which give the video
stream's text embeddings, the audio stream's and the mask both streams attend with.

Both run here, in the text encoder stage. The connectors depend on the text alone: every row of their batch is
computed on its own (the per-layer norm over the row's real tokens in LTX-2.0, the per-token norm in LTX-2.3, the
learnable registers that fill the row's padding, attention within the row), and the pipeline's batch of negative
and positive prompt gives each the same rows as a batch of one. So their output is cached per text like any
embedding, and it is what travels to the DiT: the video and audio embeddings at the connectors' widths (3840 each
in LTX-2.0, 4096 and 2048 in LTX-2.3) rather than Gemma's 49 stacked hidden states (188160 wide).

Each text is encoded alone at the padded length, as the pipeline pads it: the registers replace the padding at
the end of the sequence, so the connectors' output is always `max_sequence_length` long, and with registers its
mask is all ones. Per text: "video_embeds" [L, video width], "audio_embeds" [L, audio width] (the connectors'
dtype) and "embeds_mask" [L] (int64, 1 where the transformer attends). They travel as "prompt_video_embeds",
"prompt_audio_embeds", "prompt_embeds_mask" (and "negative_...").
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained

# LTX2Pipeline pads Gemma's input on the left (`_get_gemma_prompt_embeds` sets it) and tells the connectors so.
PADDING_SIDE = "left"
# The tensors of one text, in the order they travel.
NAMES = ("video_embeds", "audio_embeds", "embeds_mask")


class LTX2PromptEncoder(PromptEncoder):
    """Gemma 3 and LTX2TextConnectors, with LTX2Pipeline's tokenization, padding and stacking of hidden states."""

    other_components = ("connectors",)

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
        gemma = load_pretrained(
            Gemma3ForConditionalGeneration,
            model_dir / "text_encoder",
            device=device,
            dtype=dtype,
            num_threads=load_threads,
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        tokenizer.padding_side = PADDING_SIDE
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        super().__init__(model_id, device, tokenizer, gemma, cache_bytes, cache_entries)
        self.connectors = load_pretrained(
            LTX2TextConnectors, model_dir / "connectors", device=device, dtype=dtype, num_threads=load_threads
        ).eval()

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.text_encoder, "connectors": self.connectors}

    def _tokens(self, text: str, max_sequence_length: int) -> dict[str, torch.Tensor]:
        """The pipeline's input ids and attention mask [1, L]: the stripped text after <bos>, left-padded to L."""
        return self.tokenizer(
            [text.strip()],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )

    def embed_uncached(self, text: str, max_sequence_length: int) -> dict[str, torch.Tensor]:
        """{"video_embeds": [L, video width], "audio_embeds": [L, audio width], "embeds_mask": [L]} of one text,
        L = max_sequence_length."""
        tokens = self._tokens(text, max_sequence_length)
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        hidden_states = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        # Every hidden state side by side per position, in the text encoder's dtype (the pipeline's `prompt_embeds`).
        stacked = torch.stack(hidden_states, dim=-1).flatten(2, 3).to(self.text_encoder.dtype)
        video, audio, attended = self.connectors(stacked, mask, padding_side=PADDING_SIDE)
        return {"video_embeds": video[0].cpu(), "audio_embeds": audio[0].cpu(), "embeds_mask": attended[0].cpu()}

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """The cut at `max_sequence_length` tokens, <bos> counted, as the pipeline's tokenizer call cuts it."""
        count = len(self.tokenizer([text.strip()], add_special_tokens=True)["input_ids"][0])
        if count > max_sequence_length:
            return Truncation(given=count, kept=max_sequence_length)
        return None

    def batch(self, embeddings: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The texts' tensors stacked: "video_embeds" [N, L, video width], "audio_embeds" [N, L, audio width] and
        "embeds_mask" [N, L]; every text of a request has its max_sequence_length, L."""
        lengths = {embedding["embeds_mask"].shape[0] for embedding in embeddings}
        if len(lengths) > 1:
            raise ValueError(f"texts of one request are encoded at one length; got {sorted(lengths)}")
        return {name: torch.stack([embedding[name] for embedding in embeddings]) for name in NAMES}
