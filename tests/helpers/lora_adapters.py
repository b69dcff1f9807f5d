"""LoRA adapter files for the tests, written by diffusers' own saver from PEFT's layers (no hand-made format)."""

from __future__ import annotations

from pathlib import Path

import diffusers
import torch
from peft import LoraConfig, get_peft_model_state_dict

# The linears an adapter of the tests wraps: attention projections (self and cross) and the feed-forward.
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
QWEN_TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]


def write_adapter(
    model_dir: Path,
    path: Path,
    *,
    pipeline: str,
    transformer_class: str,
    targets: list[str],
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    strength: float = 0.3,
) -> Path:
    """An adapter for the checkpoint's transformer at `path` (one safetensors file, as `pipe.save_lora_weights`
    writes it, with the PEFT config in its header): lora_A and lora_B drawn from `seed`, B scaled to
    `strength`, so that it changes the output without overwhelming it."""
    transformer = getattr(diffusers, transformer_class).from_pretrained(model_dir / "transformer")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="written")
    state = get_peft_model_state_dict(transformer, adapter_name="written")
    state = {key: value * strength if "lora_B" in key else value for key, value in state.items()}
    directory = path.parent / f".{path.stem}-saved"
    getattr(diffusers, pipeline).save_lora_weights(
        directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    (directory / "pytorch_lora_weights.safetensors").rename(path)
    directory.rmdir()
    return path


def wan_adapter(model_dir: Path, path: Path, seed: int, **options) -> Path:
    return write_adapter(
        model_dir,
        path,
        pipeline="WanPipeline",
        transformer_class="WanTransformer3DModel",
        targets=WAN_TARGETS,
        seed=seed,
        **options,
    )


def qwen_adapter(model_dir: Path, path: Path, seed: int, **options) -> Path:
    return write_adapter(
        model_dir,
        path,
        pipeline="QwenImagePipeline",
        transformer_class="QwenImageTransformer2DModel",
        targets=QWEN_TARGETS,
        seed=seed,
        **options,
    )
