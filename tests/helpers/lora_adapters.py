"""LoRA adapter files for the tests: diffusers' format, written by diffusers' own saver from PEFT's layers; and
FLUX.1's community formats, whose keys are written as their trainers name them (random weights), for diffusers'
FluxPipeline to convert."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import safetensors.torch
import torch
from peft import LoraConfig, get_peft_model_state_dict

# The linears an adapter of the tests wraps: attention projections (self and cross) and the feed-forward.
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
QWEN_TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]
# FLUX.1: both streams' attention, the single-stream blocks' MLP input and their output projections, and the
# final projection (where the sequence-parallel plan gathers the image tokens).
FLUX_TARGETS = [*QWEN_TARGETS, "proj_mlp", "proj_out"]
# Z-Image's single-stream blocks (refiners and main layers alike): attention and the SwiGLU feed-forward.
Z_IMAGE_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
# FLUX.2's double-stream attention, the single-stream blocks' fused projection and the output projection.
FLUX2_TARGETS = [*QWEN_TARGETS, "to_qkv_mlp_proj", "proj_out"]
# FLUX.1's community formats: three that FluxLoraLoaderMixin.lora_state_dict converts, kohya's sd-scripts
# ("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", an alpha per layer), ComfyUI's, which keeps BFL's
# module names ("diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight"), and XLabs'
# ("double_blocks.0.processor.qkv_lora1.down.weight", no alpha); and "bfl-peft", BFL's names with PEFT's
# lora_A/lora_B ("diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"), which diffusers 0.42.1 leaves
# unconverted and the family's own loader reads (families/flux/lora.py). "peft-alphas" is diffusers' own names
# with an alpha per layer ("transformer.transformer_blocks.0.attn.to_q.alpha"), which FluxPipeline's loader keeps
# apart as network alphas.
FLUX_FORMATS = ("kohya", "comfyui", "xlabs", "peft-alphas", "bfl-peft")


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


def _bfl_layers(config: dict) -> dict[str, tuple[int, int]]:
    """BFL's name of each linear a kohya or ComfyUI adapter of the tests wraps: (out, in) features. Not the
    single-stream blocks' linear1, which diffusers' kohya converter splits at FLUX.1-dev's own widths."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    layers = {}
    for block in range(config["num_layers"]):
        for stream in ("img", "txt"):
            prefix = f"double_blocks.{block}.{stream}"
            layers[f"{prefix}_attn.qkv"] = (3 * width, width)
            layers[f"{prefix}_attn.proj"] = (width, width)
            layers[f"{prefix}_mlp.0"] = (4 * width, width)
            layers[f"{prefix}_mlp.2"] = (width, 4 * width)
            layers[f"{prefix}_mod.lin"] = (6 * width, width)
    for block in range(config["num_single_layers"]):
        layers[f"single_blocks.{block}.linear2"] = (width, 5 * width)
        layers[f"single_blocks.{block}.modulation.lin"] = (3 * width, width)
    return layers


def flux_community_adapter(model_dir: Path, path: Path, layout: str, seed: int, rank: int = 4) -> Path:
    """An adapter for the FLUX.1 checkpoint's transformer in one of FLUX_FORMATS, its weights drawn from `seed`
    (kohya's and ComfyUI's with alpha 2 * rank, so that their converter scales them; "peft-alphas" with alphas of
    rank, 2 * rank and 3 * rank by turns, so that they differ from layer to layer)."""
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)

    def pair(out: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(rank, features, generator=generator) * 0.3, torch.randn(out, rank, generator=generator) * 0.3

    state: dict[str, torch.Tensor] = {}
    if layout == "xlabs":
        width = config["num_attention_heads"] * config["attention_head_dim"]
        for block in range(config["num_layers"]):
            for stream in ("1", "2"):  # 1: the image stream, 2: the text stream
                for layer, out in ((f"qkv_lora{stream}", 3 * width), (f"proj_lora{stream}", width)):
                    down, up = pair(out, width)
                    state[f"double_blocks.{block}.processor.{layer}.down.weight"] = down
                    state[f"double_blocks.{block}.processor.{layer}.up.weight"] = up
    elif layout == "peft-alphas":
        width = config["num_attention_heads"] * config["attention_head_dim"]
        modules = [f"transformer_blocks.{block}.attn.{layer}" for block in range(config["num_layers"])
                   for layer in ("to_q", "to_v", "add_k_proj", "to_add_out")]  # fmt: skip
        modules += [f"single_transformer_blocks.{block}.attn.to_k" for block in range(config["num_single_layers"])]
        for index, module in enumerate(modules):
            down, up = pair(width, width)
            state[f"transformer.{module}.lora_A.weight"], state[f"transformer.{module}.lora_B.weight"] = down, up
            state[f"transformer.{module}.alpha"] = torch.tensor(float(rank * (1 + index % 3)))
    else:
        for module, (out, features) in _bfl_layers(config).items():
            down, up = pair(out, features)
            if layout == "kohya":
                prefix, parts = "lora_unet_" + module.replace(".", "_"), ("lora_down", "lora_up")
            else:
                prefix = "diffusion_model." + module
                parts = ("lora_down", "lora_up") if layout == "comfyui" else ("lora_A", "lora_B")
            state[f"{prefix}.{parts[0]}.weight"], state[f"{prefix}.{parts[1]}.weight"] = down, up
            if layout != "bfl-peft":
                state[f"{prefix}.alpha"] = torch.tensor(2.0 * rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(path))
    return path
