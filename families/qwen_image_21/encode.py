"""Prompt encoding exactly as QwenImage21Pipeline.encode_prompt does it for text-to-image.

Qwen-Image 2.1 conditions on Qwen3-VL's language model run over the prompt filled into the pipeline's raw
template (system message "Comprehend and analyze the provided prompt.", then the user's turn). The embedding is
the last decoder layer's output *before* the language model's final RMSNorm: the pipeline hooks that norm to
return its input, and so does this encoder. The system message's tokens (as the processor's chat template
renders that message alone) are dropped; an empty prompt is encoded as " ". The pipeline does not truncate.

Each text is encoded alone, as the pipeline encodes prompt and negative prompt in separate calls (no padding);
the padding to the longest text and the masks sent are Qwen-Image's (families/qwen_image/encode.py `batch`).
Condition images (the pipeline's image-conditioned template) are not served by this family yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.utils import is_torchvision_available

from families.qwen_image.encode import QwenPromptEncoder
from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES
from stagekit.encoder import PromptEncoder
from stagekit.weights import load_pretrained

# QwenImage21Pipeline's sys_prompt and prompt_template_t2i.
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
PROMPT_TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
)


class _TextImageProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor, which transformers builds only with torchvision."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(path: str | Path) -> Qwen3VLProcessor:
    """The checkpoint's `processor`, as QwenImage21Pipeline.from_pretrained loads it where torchvision is installed.
    Without torchvision the same class is made from the directory's tokenizer, image processor and chat template:
    the pipeline gives it text (and images) only, so it makes the same tokens."""
    path = Path(path)
    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(path)
    return _TextImageProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=(path / "chat_template.jinja").read_text(),
    )


class Qwen21PromptEncoder(PromptEncoder):
    """Qwen3-VL prompt encoder with QwenImage21Pipeline's template, system-message drop and pre-norm read-out."""

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
            Qwen3VLForConditionalGeneration,
            model_dir / "text_encoder",
            device=device,
            dtype=dtype,
            num_threads=load_threads,
        )
        self.processor = load_processor(model_dir / "processor")
        super().__init__(model_id, device, self.processor.tokenizer, text_encoder, cache_bytes, cache_entries)
        # The pipeline's _drop_idx: the tokens of the system message as the chat template renders it alone.
        system = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
        self.drop_idx = len(self.processor.apply_chat_template(system, tokenize=True, return_dict=False)[0])

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.text_config.hidden_size

    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """The [L, dim] embedding of one text (`max_sequence_length` is not applied: the pipeline cuts nothing)."""
        inputs = self.processor(
            text=[PROMPT_TEMPLATE.format(text or " ")], padding=True, padding_side="left", return_tensors="pt"
        ).to(self.device)
        forward: dict[str, Any] = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
        if "mm_token_type_ids" in inputs:
            forward["mm_token_type_ids"] = inputs["mm_token_type_ids"]
        language_model = self.text_encoder.model.language_model
        # As the pipeline: the final norm returns its input, so hidden_states[-1] is the last layer's output.
        handle = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            output = self.text_encoder(**forward, output_hidden_states=True)
        finally:
            handle.remove()
        hidden = output.hidden_states[-1][0]
        # _extract_masked_hidden for a batch of one, then the system message dropped; a copy of its own, so that
        # the cache holds these rows only.
        hidden = hidden[inputs.attention_mask[0].bool()][self.drop_idx :]
        return hidden.to(self.text_encoder.dtype).cpu().clone()

    batch = QwenPromptEncoder.batch
