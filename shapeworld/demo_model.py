"""The demo checkpoint: a tiny Wan2.1 text-to-video model trained on the shape world, and how it is made.

`train(out, seed, ...)` writes a diffusers checkpoint that `WanPipeline.from_pretrained(out)` loads unchanged:

    tokenizer/      a T5-style Unigram tokenizer trained locally on the built-in corpus and the training prompts
    text_encoder/   UMT5EncoderModel, random and frozen (below)
    vae/            AutoencoderKLWan trained as a video autoencoder (shapeworld/train_vae.py); latents_mean and
                    latents_std in its config are the statistics of its latents over the training scenes
    transformer/    WanTransformer3DModel, trained with flow matching on those latents (shapeworld/train_dit.py)
    scheduler/      UniPCMultistepScheduler with flow sigmas, as Wan2.1 ships it, with FLOW_SHIFT for this model
    model_index.json, stagediff.json (the request the model is made for), training.json (how it was made)

The text encoder stays random: its embeddings are then computed once per training prompt (the DiT's training
fits its budget), a random UMT5 keeps each word's identity, all the DiT needs, and held-out phrasings test reading.

The committed checkpoint (`CHECKPOINT`, used by `stagediff init-model --family wan-t2v --preset demo` and
`make demo`) comes from `python scripts/train_demo_model.py --out DIR --seed 0 --vae-from shapeworld/checkpoint`
(the autoencoder kept from an earlier checkpoint; docs/demo_model.md says why). Its training.json records the
command, the seed, the wall time, the final losses and, under `vae_from`, how that autoencoder was trained.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from families.init_model import save_component, save_tokenizer, write_default_request, write_model_index
from families.registry import family_named
from families.wan.components import build_tokenizer
from families.wan.presets import COMPONENT_CLASSES, TRANSFORMER_CONFIGS
from shapeworld.train_dit import DitSchedule, PromptBank, encode_scenes, train_dit, training_prompts
from shapeworld.train_vae import VaeSchedule, train_vae
from shapeworld.world import training_concepts

CHECKPOINT = Path(__file__).parent / "checkpoint"

TOKENIZER: dict[str, int] = dict(vocab_size=2000, corpus_sentences=6000, corpus_names=2000)

# UMT5Config keys (see families/wan/presets.py for what each means); d_model is the DiT's text_dim.
TEXT_ENCODER: dict[str, Any] = dict(
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

# WanTransformer3DModel: the tiny preset's layout, 128 wide (4 heads of 32), 4 blocks, reading 64-wide text.
TRANSFORMER: dict[str, Any] = dict(
    TRANSFORMER_CONFIGS["tiny"], attention_head_dim=32, text_dim=64, ffn_dim=512, num_layers=4
)

# AutoencoderKLWan in the Wan2.1 layout (8x spatial, 4x temporal), 16 channels wide at full resolution.
VAE: dict[str, Any] = dict(
    base_dim=16,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)

FLOW_SHIFT = 4.0
DEFAULT_REQUEST: dict[str, Any] = dict(height=64, width=64, num_frames=17, num_inference_steps=20, guidance_scale=5.0)
SEQUENCE_LENGTH = 512  # WanPipeline's max_sequence_length, which the stages use too

# A few steps of each phase: `--quick`, for the test that the script runs end to end.
QUICK_VAE = VaeSchedule(image_steps=2, video_steps=2, image_batch=2, video_batch=1, whole_every=2, whole_batch=1)
QUICK_DIT = DitSchedule(scenes=8, steps=4, batch=2, warmup_steps=2)

# What training.json keeps of the run that trained an autoencoder reused with `vae_from`.
VAE_PROVENANCE = ("command", "seed", "wall_seconds", "vae_schedule", "torch", "threads", "machine")

Progress = Callable[[str, int, int, dict[str, float]], None]


def train(
    out: Path,
    seed: int = 0,
    vae_schedule: VaeSchedule | None = None,
    dit_schedule: DitSchedule | None = None,
    on_progress: Progress | None = None,
    command: str = "",
    vae_from: Path | None = None,
) -> dict[str, Any]:
    """Trains every component and writes the checkpoint to `out`; returns what training.json records.

    With `vae_from` (a checkpoint directory), its trained autoencoder is kept instead of training one: only its
    latent statistics are computed again, on this world's scenes, and its training record is carried over.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from families.wan.encode import WanPromptEncoder

    vae_schedule = vae_schedule or VaeSchedule()
    dit_schedule = dit_schedule or DitSchedule()
    report = on_progress or (lambda phase, step, total, losses: None)
    if vae_from is not None and vae_from.resolve() == out.resolve():
        raise ValueError(f"vae_from must be another checkpoint than out ({out}): out's files are rewritten")
    out.mkdir(parents=True, exist_ok=True)
    family = family_named("wan-t2v")
    concepts = training_concepts()
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    # Text: the tokenizer knows the words of the training prompts; the encoder is random and frozen.
    lines = sorted({text for concept in concepts for text in training_prompts(concept)})
    tokenizer = build_tokenizer(**TOKENIZER, extra_lines=lines)
    save_tokenizer(tokenizer, out)
    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(tokenizer), **TEXT_ENCODER)
    save_component(UMT5EncoderModel(config).eval(), out, "text_encoder", {})
    seconds["text_encoder"] = time.perf_counter() - started

    # The autoencoder: trained here, or kept from `vae_from` with the record of how it was trained.
    phase_started = time.perf_counter()
    if vae_from is None:
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**VAE)
        vae_losses = train_vae(
            vae, concepts, vae_schedule, seed, lambda step, losses: report("vae", step + 1, vae_schedule.steps, losses)
        )
        vae_record: dict[str, Any] = {"vae_schedule": asdict(vae_schedule)}
    else:
        vae = AutoencoderKLWan.from_pretrained(vae_from / "vae")  # in eval mode, as loaded
        kept = json.loads((vae_from / "training.json").read_text())
        vae_losses = kept["final_losses"]["vae"]
        vae_record = {"vae_from": kept.get("vae_from") or {k: kept[k] for k in VAE_PROVENANCE}}
    seconds["vae"] = time.perf_counter() - phase_started

    # Its latents of the training scenes, and their statistics into its config.
    phase_started = time.perf_counter()
    data = encode_scenes(vae, concepts, dit_schedule, seed, lambda done, total: report("latents", done, total, {}))
    vae.register_to_config(
        latents_mean=[round(float(v), 5) for v in data.mean], latents_std=[round(float(v), 5) for v in data.std]
    )
    save_component(vae, out, "vae", {})
    seconds["latents"] = time.perf_counter() - phase_started

    # Every training prompt through the serving code's encoder (run on the prompts' own length: the values past
    # it would be zero, and the encoder masks them out of the rest).
    phase_started = time.perf_counter()
    encoder = WanPromptEncoder(out, "demo", torch.device("cpu"), torch.float32)
    prompts = PromptBank(
        lambda texts: encoder.embed_many(texts, SEQUENCE_LENGTH, pad_to_longest=True), data.concepts, SEQUENCE_LENGTH
    )
    seconds["prompts"] = time.perf_counter() - phase_started

    # The DiT.
    phase_started = time.perf_counter()
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TRANSFORMER)
    average, dit_losses = train_dit(
        transformer,
        data,
        prompts,
        dit_schedule,
        seed,
        lambda step, losses: report("dit", step + 1, dit_schedule.steps, losses),
    )
    save_component(average, out, "transformer", {})
    seconds["dit"] = time.perf_counter() - phase_started

    UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT
    ).save_pretrained(out / "scheduler")
    write_model_index(out, family, dict(COMPONENT_CLASSES))
    write_default_request(out, family, DEFAULT_REQUEST)
    record = {
        "command": command,
        "seed": seed,
        "wall_seconds": {
            name: round(value, 1) for name, value in {**seconds, "total": time.perf_counter() - started}.items()
        },
        "final_losses": {"vae": vae_losses, "dit": dit_losses},
        **vae_record,
        "dit_schedule": asdict(dit_schedule),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
