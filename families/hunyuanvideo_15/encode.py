"""Prompt encoding exactly as HunyuanVideo15Pipeline.encode_prompt does it: Qwen2.5-VL's sequence and ByT5's glyphs.

HunyuanVideo 1.5 conditions on two text encoders run over the same text, both in this stage:
- Qwen2.5-VL's language model (`text_encoder`, a Qwen2_5_VLTextModel) over the prompt filled into the tokenizer's
  chat template with the pipeline's system message; the hidden state three from the end (`hidden_states[-3]`),
  with the template's first 108 tokens (the pipeline's `prompt_template_encode_start_idx`) dropped. An empty text
  is templated as " ", as the pipeline does.
- ByT5 (`text_encoder_2`, a T5 encoder over bytes) over the quoted text in the prompt, the glyphs the video should
  render (`extract_glyph_texts`: `"..."` or `“...”`, joined as `Text "...". `); a prompt without quotes has no glyph
  embedding, which the pipeline sends as a fully masked block of zeros.

The pipeline pads both to fixed lengths (1000 and 256 tokens) and masks the padding; the transformer moves every
masked position after the real ones and attends to none of them, so only the real positions matter. This stage
sends each text at its own length, padded to the longest text of the request with masks: "embeds" [N, L, 3584] with
"embeds_mask", and "glyph_embeds" [N, G, 1472] with "glyph_embeds_mask", at least one (masked) row when no text has
glyphs. They travel as "prompt_embeds", "prompt_embeds_mask", "prompt_glyph_embeds", ... (and "negative_...").
Both encoders run on unpadded input: the language model is causal and ByT5 masks padded keys, so the real rows equal
the pipeline's padded run's up to float rounding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLTextModel, SiglipImageProcessor, SiglipVisionModel, T5EncoderModel

from families.base import crop_bucket
from families.hunyuanvideo_15.vae_encode import cropped
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.weights import load_pretrained

# HunyuanVideo15Pipeline's system message, verbatim (its line continuations keep the source's indentation).
SYSTEM_MESSAGE = "You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video."
# prompt_template_encode_start_idx: the templated tokens dropped from the front of the sequence.
CROP_START = 108
# hidden_states[-(num_hidden_layers_to_skip + 1)] with the pipeline's num_hidden_layers_to_skip of 2.
HIDDEN_STATE_INDEX = -3
# tokenizer_2_max_length: ByT5 bytes (its end token included) of the glyph text.
GLYPH_MAX_LENGTH = 256
_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """The prompt's quoted texts as the pipeline formats them for ByT5 (`extract_glyph_texts`), None without any."""
    found = [plain or curly for plain, curly in _QUOTED.findall(prompt)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    if not found:
        return None
    return ". ".join(f'Text "{text}"' for text in found) + ". "


class HunyuanVideo15PromptEncoder(PromptEncoder):
    """Qwen2.5-VL + ByT5 prompt encoder with HunyuanVideo15Pipeline's template, crop and glyph extraction."""

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
        qwen = load_pretrained(
            Qwen2_5_VLTextModel, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        super().__init__(model_id, device, tokenizer, qwen, cache_bytes, cache_entries)
        # The same tokenizer, typed as what it is: the chat template is rendered by it.
        self.chat_tokenizer: Any = tokenizer
        self.byt5 = load_pretrained(
            T5EncoderModel, model_dir / "text_encoder_2", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.byt5_tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer_2")

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.text_encoder, "text_encoder_2": self.byt5}

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.hidden_size

    @property
    def glyph_size(self) -> int:
        return self.byt5.config.d_model

    def _template_ids(self, text: str, max_sequence_length: int | None) -> list[int]:
        conversation = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": text or " "}]
        limit = {} if max_sequence_length is None else {"max_length": max_sequence_length + CROP_START}
        encoded = self.chat_tokenizer.apply_chat_template(
            [conversation], add_generation_prompt=True, tokenize=True, return_dict=True, truncation=bool(limit), **limit
        )
        return list(encoded["input_ids"][0])

    def embed_uncached(self, text: str, max_sequence_length: int) -> dict[str, torch.Tensor]:
        """{"embeds": [L, 3584] (Qwen2.5-VL, L <= max_sequence_length), "glyph_embeds": [G, 1472] (ByT5, G = 0
        without quoted text)} of one text."""
        ids = torch.tensor([self._template_ids(text, max_sequence_length)], device=self.device)
        hidden = self.text_encoder(
            input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True
        ).hidden_states[HIDDEN_STATE_INDEX]
        # A copy of its own, so that the cache holds (and counts) these rows only.
        embeds = hidden[0, CROP_START:].to(self.text_encoder.dtype).cpu().clone()
        glyphs = glyph_text(text)
        if glyphs is None:
            glyph_embeds = torch.zeros(0, self.glyph_size, dtype=self.byt5.dtype)
        else:
            tokens = self.byt5_tokenizer(
                [glyphs], max_length=GLYPH_MAX_LENGTH, truncation=True, add_special_tokens=True, return_tensors="pt"
            ).to(self.device)
            output = self.byt5(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float())[0]
            glyph_embeds = output[0].to(self.byt5.dtype).cpu()
        return {"embeds": embeds, "glyph_embeds": glyph_embeds}

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """Qwen2.5-VL's cut at `max_sequence_length` tokens after the template's first 108 (the template's closing
        tokens counted, as the pipeline's truncation counts them); ByT5's cut of the glyph text at 256 bytes is
        reported only when Qwen keeps the whole text."""
        count = len(self._template_ids(text, None)) - CROP_START
        if count > max_sequence_length:
            return Truncation(given=count, kept=max_sequence_length)
        glyphs = glyph_text(text)
        if glyphs is not None:
            glyph_count = len(self.byt5_tokenizer([glyphs], verbose=False).input_ids[0])
            if glyph_count > GLYPH_MAX_LENGTH:
                return Truncation(given=glyph_count, kept=GLYPH_MAX_LENGTH, encoder="ByT5")
        return None

    def batch(self, embeddings: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each encoder's rows zero-padded to the request's longest text, with int64 masks (1 = token): "embeds",
        "embeds_mask", "glyph_embeds" and "glyph_embeds_mask" (at least one row, masked where no text has one)."""
        batched: dict[str, torch.Tensor] = {}
        for name in ("embeds", "glyph_embeds"):
            rows = [embedding[name] for embedding in embeddings]
            longest = max(1, *(row.shape[0] for row in rows))
            padded = torch.zeros(len(rows), longest, rows[0].shape[1], dtype=rows[0].dtype)
            mask = torch.zeros(len(rows), longest, dtype=torch.long)
            for i, row in enumerate(rows):
                padded[i, : row.shape[0]] = row
                mask[i, : row.shape[0]] = 1
            batched[name], batched[f"{name}_mask"] = padded, mask
        return batched


class HunyuanVideo15ImageConditionEncoder(HunyuanVideo15PromptEncoder):
    """The prompts as text-to-video encodes them, and the first frame as HunyuanVideo15ImageToVideoPipeline
    embeds it: cropped to the output size (the crop bucket of the transformer's target size nearest the image's
    aspect ratio: the pipeline takes no other size, and neither does this family), then SigLIP's last hidden state.
    """

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
        super().__init__(model_dir, model_id, device, dtype, cache_bytes, cache_entries, load_threads)
        model_dir = Path(model_dir)
        self.image_encoder = load_pretrained(
            SiglipVisionModel, model_dir / "image_encoder", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.feature_extractor = SiglipImageProcessor.from_pretrained(model_dir / "feature_extractor")
        transformer = json.loads((model_dir / "transformer" / "config.json").read_text())
        vae = json.loads((model_dir / "vae" / "config.json").read_text())
        self.target_size = int(transformer.get("target_size", 640))
        self.spatial = int(vae.get("spatial_compression_ratio", 16))

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {**super().modules, "image_encoder": self.image_encoder}

    def embed_images_uncached(self, images: list[Image.Image]) -> torch.Tensor:
        """[1, tokens, dim]: SigLIP's last hidden state of the first frame, cropped to its output size."""
        (image,) = images
        width, height = crop_bucket(image.width, image.height, self.target_size, self.spatial)
        pixels = self.feature_extractor.preprocess(
            images=cropped(image, height, width, self.spatial), do_resize=True, return_tensors="pt", do_convert_rgb=True
        ).to(self.device, self.image_encoder.dtype)
        return self.image_encoder(**pixels).last_hidden_state.cpu()
