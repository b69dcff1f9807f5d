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
from typing import Any

from families.base import DEFAULTS_FILE, Family, RequestDefaults
from families.registry import REGISTRY, family_for_index, family_named
from services.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from services.model_source import model_id_of
from stagediff.v1 import stages_pb2


class CheckpointError(ValueError):
    """The directory is not a checkpoint this build can serve."""


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
    # Input images: the roles the checkpoint takes and requires (its family's, unless its configs narrow
    # them), and the bounds on what a request may send (services/images.py).
    image_roles: tuple[str, ...] = ()
    required_image_roles: tuple[str, ...] = ()
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    # The transformer's attention heads, which a parallel layout must divide (its config's num_attention_heads
    # unless the family's reader names another key: Z-Image's n_heads).
    attention_heads: int | None = None
    # Whether the transformer takes the guidance scale as an input (FLUX.1-dev), the request's
    # embedded_guidance_scale; a request naming it for any other model is refused.
    embedded_guidance: bool = False
    # For a family whose pipeline takes the output size from an input image by crop buckets (HunyuanVideo 1.5
    # image-to-video): the side of the square whose area the buckets have; 0 otherwise.
    image_size_base: int = 0
    # For a model that makes sound with its video (LTX-2): the sample rate and channels of the waveform its VAE
    # stage sends (its vocoder's output); 0 and 0 for a model without sound.
    audio_sample_rate: int = 0
    audio_channels: int = 0

    @property
    def traits(self) -> Family:
        """The family's declarations (families/): its chain, conditioning, features and compute."""
        return family_named(self.family)

    @property
    def height_multiple(self) -> int:
        return self.vae_scale_spatial * self.patch_size[1]

    @property
    def width_multiple(self) -> int:
        return self.vae_scale_spatial * self.patch_size[2]

    def limits(self) -> stages_pb2.ModelLimits:
        d = self.defaults
        embedded = None
        if self.embedded_guidance:
            # A defaults file may leave it out: the family's reference value then (FLUX.1-dev's 3.5).
            embedded = d.embedded_guidance_scale
            if embedded is None:
                embedded = self.traits.defaults.embedded_guidance_scale
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
            image_roles=self.image_roles,
            required_image_roles=self.required_image_roles,
            max_images=len(self.image_roles),
            max_image_bytes=self.max_image_bytes if self.image_roles else 0,
            max_image_pixels=self.max_image_pixels if self.image_roles else 0,
            default_embedded_guidance_scale=embedded,
            image_size_base=self.image_size_base,
            audio_sample_rate=self.audio_sample_rate,
            audio_channels=self.audio_channels,
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; is {path.parent} a diffusers checkpoint?") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def read_checkpoint(path: str | Path, model_id: str | None = None) -> CheckpointSpec:
    """Reads a checkpoint's configs; raises CheckpointError naming what is wrong."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    index = _read_json(root / "model_index.json")
    family = family_for_index(index)
    if family is None:
        raise CheckpointError(
            f"{root}: pipeline '{index.get('_class_name', '')}' is not supported; supported: {', '.join(REGISTRY)}"
        )
    configs: dict[str, dict[str, Any]] = {
        "vae": _read_json(root / "vae" / "config.json"),
        "transformer": _read_json(root / "transformer" / "config.json"),
        "scheduler": _read_json(root / "scheduler" / "scheduler_config.json"),
        # The pipeline's own config entries (FLUX.2 klein's `is_distilled` decides its defaults).
        "model_index": index,
    }
    if "guider" in index:
        # A pipeline whose guidance is a diffusers guider component (HunyuanVideo 1.5): its scale is the default.
        configs["guider"] = _read_json(root / "guider" / "guider_config.json")
    if "vocoder" in index:
        # A pipeline that makes sound (LTX-2): its vocoder's output rate and channels are the waveform's.
        configs["vocoder"] = _read_json(root / "vocoder" / "config.json")
    # The family reads its geometry (VAE and patch factors, latent channels, its limits) from the configs, and
    # may choose defaults by variant (FLUX.1-dev's and schnell's).
    try:
        read_geometry = family.load("checkpoint_reader")(configs)
    except CheckpointError:
        raise
    except ValueError as error:  # the family's reader names what it cannot serve
        raise CheckpointError(f"{root}: {error}") from None
    geometry = {
        "image_roles": family.images.roles,
        "required_image_roles": family.images.required,
        "attention_heads": configs["transformer"].get("num_attention_heads"),
        **read_geometry,
    }
    defaults = geometry.pop("defaults", family.defaults)
    defaults_path = root / DEFAULTS_FILE
    if defaults_path.exists():
        defaults = RequestDefaults(**_read_json(defaults_path).get("default_request", {}))
    return CheckpointSpec(
        path=root,
        model_id=model_id or model_id_of(root),
        family=family.name,
        num_train_timesteps=configs["scheduler"].get("num_train_timesteps", 1000),
        defaults=defaults,
        **geometry,
    )
