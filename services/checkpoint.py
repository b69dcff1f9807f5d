"""Reading what a diffusers checkpoint directory is, without loading its weights.

Every stage is started with `--model DIR`. Before loading anything it reads the
directory's JSON configs into a `CheckpointSpec`: the family, the VAE and patch
factors that decide which sizes and frame counts are valid, and the request
defaults. The DiT stage reports these as `ModelLimits`, and the orchestrator
validates every request against them before any stage does work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from stagediff.v1 import stages_pb2

# model_index.json `_class_name` -> family name. A WanPipeline with two experts is its own family
# (see family_of).
FAMILY_OF_PIPELINE = {"WanPipeline": "wan-t2v", "QwenImagePipeline": "qwen-image"}
# Families whose stages run the Wan compute (UMT5 encoder, WanDenoiser, streaming Wan VAE).
WAN_FAMILIES = ("wan-t2v", "wan2.2-a14b")
# Families that make one image per request.
IMAGE_FAMILIES = ("qwen-image",)
# Optional file written by `stagediff init-model` with the request a preset is sized for.
DEFAULTS_FILE = "stagediff.json"


class CheckpointError(ValueError):
    """The directory is not a checkpoint this build can serve."""


@dataclass(frozen=True)
class RequestDefaults:
    """Used for fields a request leaves unset; the Wan2.1 reference values unless the checkpoint says otherwise."""

    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    fps: float = 16.0


@dataclass(frozen=True)
class CheckpointSpec:
    path: Path
    model_id: str
    family: str
    vae_scale_spatial: int
    vae_scale_temporal: int
    patch_size: tuple[int, int, int]
    latent_channels: int
    num_train_timesteps: int
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    # WanPipeline.__call__ pads prompts to 512 tokens (its encode_prompt default of 226 is not what runs).
    max_sequence_length: int = 512
    max_height: int = 1920
    max_width: int = 1920
    max_frames: int = 257
    max_prompt_chars: int = 10_000
    # The longest embedding sequence a text encoder may be asked for and the DiT accepts.
    sequence_length_limit: int = 2048

    @property
    def is_wan(self) -> bool:
        return self.family in WAN_FAMILIES

    @property
    def height_multiple(self) -> int:
        return self.vae_scale_spatial * self.patch_size[1]

    @property
    def width_multiple(self) -> int:
        return self.vae_scale_spatial * self.patch_size[2]

    def limits(self) -> stages_pb2.ModelLimits:
        d = self.defaults
        return stages_pb2.ModelLimits(
            height_multiple=self.height_multiple,
            width_multiple=self.width_multiple,
            temporal_factor=self.vae_scale_temporal,
            max_height=self.max_height,
            max_width=self.max_width,
            max_frames=self.max_frames,
            max_inference_steps=self.num_train_timesteps,
            max_sequence_length=self.max_sequence_length,
            max_prompt_chars=self.max_prompt_chars,
            default_height=d.height,
            default_width=d.width,
            default_num_frames=d.num_frames,
            default_inference_steps=d.num_inference_steps,
            default_guidance_scale=d.guidance_scale,
            default_fps=d.fps,
            min_height=self.height_multiple,
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; is {path.parent} a diffusers checkpoint?") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def family_of(index: dict) -> str | None:
    """The family of a model_index.json, or None when this build cannot serve it.

    Wan2.2-T2V-A14B is a WanPipeline with a second expert: model_index.json names `transformer_2` and
    sets the pipeline config entry `boundary_ratio`.
    """
    family = FAMILY_OF_PIPELINE.get(index.get("_class_name", ""))
    if family == "wan-t2v" and index.get("boundary_ratio") is not None and _names_component(index, "transformer_2"):
        return "wan2.2-a14b"
    return family


def _names_component(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[1] is not None


# Request defaults of real checkpoints (without a stagediff.json): each family's reference values.
# Qwen-Image: QwenImagePipeline's defaults (1024x1024, 50 steps, true_cfg_scale 4).
FAMILY_DEFAULTS = {
    "qwen-image": RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=4.0),
}


def read_checkpoint(path: str | Path, model_id: str | None = None) -> CheckpointSpec:
    """Reads a checkpoint's configs; raises CheckpointError naming what is wrong."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    index = _read_json(root / "model_index.json")
    pipeline = index.get("_class_name", "")
    family = family_of(index)
    if family is None:
        raise CheckpointError(
            f"{root}: pipeline '{pipeline}' is not supported; supported: {', '.join(FAMILY_OF_PIPELINE)}"
        )
    vae = _read_json(root / "vae" / "config.json")
    transformer = _read_json(root / "transformer" / "config.json")
    scheduler = _read_json(root / "scheduler" / "scheduler_config.json")
    temporal_downsample = vae.get("temperal_downsample", [False, True, True])
    defaults = FAMILY_DEFAULTS.get(family, RequestDefaults())
    defaults_path = root / DEFAULTS_FILE
    if defaults_path.exists():
        defaults = RequestDefaults(**_read_json(defaults_path).get("default_request", {}))
    if family == "qwen-image":
        # An image model: 2x2 patches over the latent image (an int patch_size), VAE latents of z_dim
        # channels, one frame; QwenImagePipeline refuses max_sequence_length above 1024.
        patch = transformer.get("patch_size", 2)
        return CheckpointSpec(
            path=root,
            model_id=model_id or root.name,
            family=family,
            vae_scale_spatial=2 ** len(temporal_downsample),
            vae_scale_temporal=2 ** sum(temporal_downsample),
            patch_size=(1, patch, patch),
            latent_channels=vae.get("z_dim", 16),
            num_train_timesteps=scheduler.get("num_train_timesteps", 1000),
            defaults=defaults,
            max_frames=1,
            sequence_length_limit=1024,
        )
    return CheckpointSpec(
        path=root,
        model_id=model_id or root.name,
        family=family,
        vae_scale_spatial=vae.get("scale_factor_spatial", 2 ** len(temporal_downsample)),
        vae_scale_temporal=vae.get("scale_factor_temporal", 2 ** sum(temporal_downsample)),
        patch_size=tuple(transformer.get("patch_size", (1, 2, 2))),
        latent_channels=transformer.get("in_channels", vae.get("z_dim", 16)),
        num_train_timesteps=scheduler.get("num_train_timesteps", 1000),
        defaults=defaults,
    )
