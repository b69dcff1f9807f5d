"""The parallel layouts every tester config draws from, and the Wan and Qwen-Image families' tester configs, each
describing how to run the family's DiT on its tiny checkpoint (tests/helpers/feature_mixins/base.py says what a
config declares); the image families added since have a module each beside this one (configs_<family>.py).

The image-conditioned families take the conditioning of their stage-by-stage tests (tests/helpers/wan_i2v.py,
tests/helpers/qwen_image_edit.py): Wan's frame latents (concatenated with a mask, or written over the first
frame for TI2V) and CLIP embedding, Qwen-Image-Edit's image tokens after the noise tokens.

Parallel layouts: each world size runs in one spawn of gloo ranks, every layout building its own mesh in it;
the 4-rank lists hold the layouts of the families' cluster tests (tests/e2e) among others.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    WanPipeline,
    WanTransformer3DModel,
)

from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.parallel import ParallelConfig
from tests.helpers import qwen_image_edit, wan_i2v
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.lora_adapters import QWEN_TARGETS, WAN_TARGETS

ULYSSES2 = ("ulysses2", ParallelConfig(ulysses_degree=2))
RING2 = ("ring2", ParallelConfig(ring_degree=2))
CFG2 = ("cfg2", ParallelConfig(cfg_degree=2))
TP2 = ("tp2", ParallelConfig(tp_degree=2))
HSDP2 = ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2))
HSDP2_ULYSSES2 = ("hsdp2xulysses2", ParallelConfig(ulysses_degree=2, use_hsdp=True, hsdp_shard_size=2))
USP2X2 = ("usp2x2", ParallelConfig(ulysses_degree=2, ring_degree=2))
RING2_CFG2 = ("ring2xcfg2", ParallelConfig(ring_degree=2, cfg_degree=2))
TP2_CFG2 = ("tp2xcfg2", ParallelConfig(tp_degree=2, cfg_degree=2))
TP2_RING2 = ("tp2xring2", ParallelConfig(tp_degree=2, ring_degree=2))
HSDP2X2_ULYSSES2_CFG2 = (
    "hsdp2x2xulysses2xcfg2",
    ParallelConfig(ulysses_degree=2, cfg_degree=2, use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2),
)
ULYSSES2_CFG2 = ("ulysses2xcfg2", ParallelConfig(ulysses_degree=2, cfg_degree=2))
# Every method alone on two ranks.
EACH_METHOD = [ULYSSES2, RING2, CFG2, TP2, HSDP2]
# The sequence- and CFG-parallel layouts the step caches (whose ranks agree on which passes to skip) and the
# per-request LoRA adapters run under.
SEQUENCE_AND_CFG_2 = [ULYSSES2, RING2, CFG2]


class WanTesterConfig(FamilyTesterConfig):
    """What every Wan family shares: WanTransformer3DModel, its `blocks`, a prompt and a negative prompt."""

    pipeline_class = WanPipeline
    transformer_class = WanTransformer3DModel
    blocks_attribute = "blocks"
    ignored_layers = ("proj_out", "blocks.0.*", "condition_embedder.*")
    ignored_prefixes = ("blocks.0.", "condition_embedder.")
    distinct_weight = "blocks.0.attn1.to_q.weight"

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(spec.seed)
        return {
            "prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        return denoiser.initial_noise(self.spec)

    def pipeline_latents(self, model_dir: Path, denoiser: Any, experts: dict[str, torch.nn.Module]) -> torch.Tensor:
        """WanPipeline's (text-to-video)."""
        return self.pipeline_run(WanPipeline.from_pretrained(model_dir, **experts), denoiser, self.spec)

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        pipeline.set_progress_bar_config(disable=True)
        return pipeline(
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
            **self.conditioning(denoiser, spec),
        ).frames


class WanT2VTesterConfig(WanTesterConfig):
    """Wan2.1 text-to-video: two steps with CFG; the parallel layouts run 48 tokens (64x64x9: 3 x 4 x 4) and
    30 (48x80x5: 2 x 3 x 5, which 4 does not divide)."""

    family = "wan-t2v"
    model_fixture = "tiny_model"
    pipeline_fixture = "reference_pipeline"
    spec = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1)
    parallel_specs = (
        DenoiseSpec(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0),
        spec,
    )
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    gguf_types = ("Q8_0", "Q4_0")
    # 30 tokens, which 2 x 2 does not divide: the first-block statistics leave the padding out.
    step_cache_spec = dataclasses.replace(spec, num_inference_steps=8)
    step_caches = (CacheSpec("first_block", 0.2), CacheSpec("teacache", 0.2), CacheSpec("mag", 0.3))
    step_cache_layouts = {2: SEQUENCE_AND_CFG_2, 4: [USP2X2, ULYSSES2_CFG2]}
    lora_spec = dataclasses.replace(spec, num_inference_steps=4)
    lora_targets = tuple(WAN_TARGETS)
    step_scheduling_specs = (
        dataclasses.replace(spec, num_inference_steps=5),
        dataclasses.replace(spec, num_inference_steps=3, guidance_scale=5.5, seed=2),
    )
    # Flow-matching Euler (the other scheduler family Wan checkpoints ship with), beside the tiny one's UniPC.
    step_scheduling_schedulers = {"FlowMatchEulerDiscreteScheduler": {"num_train_timesteps": 1000, "shift": 3.0}}
    lora_layouts = SEQUENCE_AND_CFG_2
    # Every method: the batch's rows travel together through the all-to-alls, the ring and the sharded weights.
    batch_layouts = EACH_METHOD
    # Tokens: 30, 27 (padded under Ulysses 2), then 32 and 45 (padded) with a shorter text.
    compile_specs = (
        spec,
        DenoiseSpec(height=48, width=48, num_frames=9, num_inference_steps=2, guidance_scale=4.0, seed=2),
        DenoiseSpec(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=3),
        DenoiseSpec(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=4.0, seed=4),
    )
    compile_text_lengths = (24, 24, 17, 17)
    parallel_layouts = {
        2: [*EACH_METHOD, HSDP2_ULYSSES2],
        4: [
            ("ulysses4", ParallelConfig(ulysses_degree=4)),
            ("ring4", ParallelConfig(ring_degree=4)),
            USP2X2,
            ULYSSES2_CFG2,
            RING2_CFG2,
            TP2_CFG2,
            HSDP2X2_ULYSSES2_CFG2,
        ],
    }

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        length = self.compile_text_lengths[index]
        return {
            "prompt_embeds": torch.randn(1, length, denoiser.text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, length, denoiser.text_dim, generator=generator),
        }


class WanA14BTesterConfig(WanTesterConfig):
    """Wan2.2 A14B: two UniPC steps, 999 on `transformer` and 750 on `transformer_2` (the boundary is
    0.875 * 1000); counting each expert's forwards makes a feature that dropped or swapped an expert fail.
    HSDP splits each expert's parameters between the ranks exactly."""

    family = "wan2.2-a14b"
    model_fixture = "a14b_model"
    pipeline_fixture = "a14b_pipeline"
    # 48x80x5 -> latents [1, 16, 2, 6, 10]: 30 tokens (even over two ranks), 6 latent rows (3 per VAE rank).
    spec = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1)
    # One step per expert, two forwards per step (the prompt and the negative prompt).
    forwards_per_expert = [2, 2]
    expert_names = ("transformer", "transformer_2")
    gguf_types = ("Q8_0",)
    parallel_layouts = {2: EACH_METHOD}
    # Both experts run some of the steps, each with its own cache state.
    step_cache_spec = dataclasses.replace(spec, num_inference_steps=8)
    step_caches = (CacheSpec("first_block", 0.2), CacheSpec("teacache", 0.2))
    step_cache_layouts = {2: [ULYSSES2, CFG2]}
    # Five steps (999, 923 | 818, 667, 429): the expert switches at step 2, so states are taken on both sides.
    step_scheduling_specs = (
        dataclasses.replace(spec, num_inference_steps=5),
        dataclasses.replace(spec, num_inference_steps=3, guidance_scale=5.5, seed=2),
    )

    def check_parallel_outputs(
        self, name: str, layout: ParallelConfig, per_rank: list[dict[str, Any]], one_rank: dict[str, Any]
    ) -> None:
        if not layout.use_hsdp:
            return
        for expert, whole in enumerate(one_rank["bytes"]):
            shards = [outputs["bytes"][expert] for outputs in per_rank]
            print(f"{name} expert {expert}: shards {shards} of {whole} parameter bytes")
            assert sum(shards) == whole, f"expert {expert}: shards add up to {sum(shards)} bytes, not {whole}"
            assert max(shards) <= 0.55 * whole, f"expert {expert}: shards {shards} of {whole} bytes"


# Ulysses, Ring, CFG-parallel, TP and HSDP alone; then the image-to-video cluster tests' layouts
# (tests/e2e/test_e2e_image_to_video.py) among others.
WAN_I2V_LAYOUTS = {2: EACH_METHOD, 4: [USP2X2, TP2_CFG2, HSDP2X2_ULYSSES2_CFG2]}


class WanI2VTesterConfig(WanTesterConfig):
    """Wan2.1 I2V: the first frame's latents concatenated to the noise with a mask, and its CLIP embedding;
    two steps with CFG."""

    family = "wan-i2v"
    spec = wan_i2v.PARALLEL_SPECS["wan-i2v"]
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    layerwise_blocks = (1,)
    parallel_layouts = WAN_I2V_LAYOUTS

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        return wan_i2v.parallel_conditioning(denoiser, spec)


class WanI2VA14BTesterConfig(WanI2VTesterConfig):
    """Wan2.2 I2V A14B: first and last frame, no CLIP; four steps with CFG, two on each expert."""

    family = "wan2.2-i2v-a14b"
    spec = wan_i2v.PARALLEL_SPECS["wan2.2-i2v-a14b"]
    forwards_per_expert = [4, 4]
    expert_names = ("transformer", "transformer_2")


class WanTI2VTesterConfig(WanI2VTesterConfig):
    """Wan2.2 TI2V-5B: the first frame's latents written over the first latent frame, a per-token timestep."""

    family = "wan2.2-ti2v"
    spec = wan_i2v.PARALLEL_SPECS["wan2.2-ti2v"]


class QwenTesterConfig(FamilyTesterConfig):
    """What the Qwen-Image families share: QwenImageTransformer2DModel, true CFG, packed latents."""

    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = QwenImageTransformer2DModel
    blocks_attribute = "transformer_blocks"
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_text_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_text_")

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        packed = denoiser.initial_noise(self.spec, torch.float32)
        return QwenImagePipeline._unpack_latents(packed, self.spec.height, self.spec.width, denoiser.vae_scale_factor)


# By seed, the (prompt, negative prompt) masks as the text encoder sends them: both texts padded to the longer
# one. A hole in a mask keeps it after the trailing padding is dropped, so it reaches the transformer.
QWEN_MASKS = {
    0: ([1, 1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    1: ([1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 1, 1, 0]),
}
# Layouts whose ranks hold only part of the weights, and so read only part of the checkpoint.
QWEN_SHARDED_READS = ("tp", "hsdp")


class QwenImageTesterConfig(QwenTesterConfig):
    """Qwen-Image: two steps with true CFG, texts of different lengths with holes in their masks. The parallel
    layouts run 16 packed image tokens (64x64) and 15 (48x80, which neither 2 nor 4 divides), and one
    transformer forward compares the text stream each block returns, which every rank computes whole; the
    sharded layouts read only part of the checkpoint."""

    family = "qwen-image"
    pipeline_class = QwenImagePipeline
    model_fixture = "qwen_model"
    pipeline_fixture = "qwen_pipeline"
    # 64x48 -> 4 x 3 packed image tokens.
    spec = DenoiseSpec(height=64, width=48, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    parallel_specs = (
        DenoiseSpec(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0),
        DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=1),
    )
    min_reference_std = 0.1
    # 48x80 -> 15 packed image tokens, which no degree divides.
    step_cache_spec = DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=8, guidance_scale=4.0, seed=1)
    step_caches = (CacheSpec("first_block", 0.5), CacheSpec("mag", 0.3))
    step_cache_layouts = {2: SEQUENCE_AND_CFG_2}
    lora_spec = dataclasses.replace(step_cache_spec, num_inference_steps=4)
    lora_targets = tuple(QWEN_TARGETS)
    lora_layouts = [ULYSSES2]
    # The second request's texts are shorter than the first's: a shared pass pads them, with their masks. The text
    # stream's products over a few tokens (the tiny checkpoint's 7) take other kernels in a batch: rows move by
    # about 1e-6 (BENCHMARKS.md, "Scheduling at the step").
    continuous_batch_tolerance = 1e-4
    step_scheduling_specs = (
        dataclasses.replace(spec, num_inference_steps=5),
        dataclasses.replace(spec, num_inference_steps=3, guidance_scale=3.0, seed=1),
    )
    # Image tokens: 16, 15 (padded), then 12 and 15 (padded). The (prompt, negative prompt) masks: a hole keeps
    # a mask, an all-ones one is dropped, so both kinds reach the blocks.
    compile_specs = (
        DenoiseSpec(height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=1),
        DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=2),
        DenoiseSpec(height=32, width=96, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=3),
        DenoiseSpec(height=80, width=48, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=4),
    )
    compile_masks = (
        ([1, 1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]),
        ([1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 1, 1, 0]),
        ([1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]),
        ([1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 0]),
    )
    parallel_layouts = {
        2: [*EACH_METHOD, HSDP2_ULYSSES2],
        4: [
            USP2X2,
            RING2_CFG2,
            TP2_CFG2,
            TP2_RING2,
            ("hsdp4xulysses2xring2", ParallelConfig(ulysses_degree=2, ring_degree=2, use_hsdp=True, hsdp_shard_size=4)),
            HSDP2X2_ULYSSES2_CFG2,
        ],
    }

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """Both texts with their masks, as the DiT stage receives them; a mask reaches the transformer."""
        from families.qwen_image.denoise import QwenTextEmbeds

        generator = torch.Generator().manual_seed(spec.seed)
        prompt_mask, negative_mask = QWEN_MASKS[spec.seed]
        conditioning = {
            "prompt_embeds": torch.randn(1, len(prompt_mask), denoiser.text_dim, generator=generator),
            "prompt_embeds_mask": torch.tensor([prompt_mask]),
            "negative_prompt_embeds": torch.randn(1, len(negative_mask), denoiser.text_dim, generator=generator),
            "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
        }
        texts = ("prompt_embeds", "negative_prompt_embeds")
        assert any(QwenTextEmbeds.from_conditioning(conditioning, text).mask is not None for text in texts)
        return conditioning

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """QwenImagePipeline's with true CFG, unpacked."""
        pipeline.set_progress_bar_config(disable=True)
        packed = pipeline(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.num_inference_steps,
            true_cfg_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="latent",
            **self.conditioning(denoiser, spec),
        ).images
        return QwenImagePipeline._unpack_latents(packed, spec.height, spec.width, pipeline.vae_scale_factor)

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        prompt_mask, negative_mask = self.compile_masks[index]
        return {
            "prompt_embeds": torch.randn(1, len(prompt_mask), denoiser.text_dim, generator=generator),
            "prompt_embeds_mask": torch.tensor([prompt_mask]),
            "negative_prompt_embeds": torch.randn(1, len(negative_mask), denoiser.text_dim, generator=generator),
            "negative_prompt_embeds_mask": torch.tensor([negative_mask]),
        }

    def parallel_outputs(self, denoiser: Any) -> dict[str, Any]:
        """Also the image output and every block's text output of one forward (15 image tokens, a masked
        text), and the bytes the rank read."""
        from stagekit.weights import load_stats

        outputs = super().parallel_outputs(denoiser)
        transformer = denoiser.transformer
        texts: list[torch.Tensor] = []
        handles = [
            block.register_forward_hook(lambda module, args, output: texts.append(output[0].clone()))
            for block in transformer.transformer_blocks
        ]
        generator = torch.Generator().manual_seed(7)
        inputs = dict(
            hidden_states=torch.randn(1, 15, transformer.config.in_channels, generator=generator),
            encoder_hidden_states=torch.randn(1, 9, denoiser.text_dim, generator=generator),
            encoder_hidden_states_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0, 0]]),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, 3, 5)]],
        )
        with torch.no_grad():
            outputs["image"] = transformer(**inputs, return_dict=False)[0]
        for handle in handles:
            handle.remove()
        outputs["texts"] = texts
        outputs["bytes_read"] = load_stats(transformer).total_bytes
        return outputs

    def check_parallel_outputs(
        self, name: str, layout: ParallelConfig, per_rank: list[dict[str, Any]], one_rank: dict[str, Any]
    ) -> None:
        sharded = layout.tp_degree > 1 or layout.use_hsdp
        for rank, outputs in enumerate(per_rank):
            differences = [(outputs["image"] - one_rank["image"]).abs().max().item()]
            pairs = zip(outputs["texts"], one_rank["texts"], strict=True)
            differences += [(text - expected).abs().max().item() for text, expected in pairs]
            print(f"{name} rank {rank}: forward image and block texts max abs diff {max(differences):.2e}")
            assert max(differences) <= 1e-4, f"{name} rank {rank}: forward differs by {max(differences):.2e}"
            read = outputs["bytes_read"]
            print(f"{name} rank {rank}: read {read} of {one_rank['bytes_read']} bytes")
            if sharded:
                assert read < 0.8 * one_rank["bytes_read"], f"{name} rank {rank}: read {read} bytes"


class QwenImageEditTesterConfig(QwenTesterConfig):
    """Qwen-Image-Edit: one input image's packed latents after the 15 noise tokens (an odd sequence, padded for
    Ulysses), a masked negative prompt; two steps with true CFG. Ulysses and Ring split the whole image
    sequence, noise then image tokens; CFG-parallel, TP and HSDP keep it whole on each rank."""

    family = qwen_image_edit.EDIT
    spec = qwen_image_edit.PARALLEL_SPECS[qwen_image_edit.EDIT]
    layerwise_blocks = (1,)
    # The image-edit cluster tests' 4-rank layouts (tests/e2e/test_e2e_image_edit.py) among them.
    parallel_layouts = {2: EACH_METHOD, 4: [USP2X2, TP2_RING2, HSDP2X2_ULYSSES2_CFG2]}

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        return qwen_image_edit.parallel_conditioning(denoiser, spec)

    def parallel_outputs(self, denoiser: Any) -> dict[str, Any]:
        """Also the image tokens (noise and image latents) the rank's attention took."""
        tokens: list[int] = []
        handle = denoiser.transformer.transformer_blocks[0].attn.register_forward_pre_hook(
            lambda module, args, kwargs: tokens.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
        )
        outputs = super().parallel_outputs(denoiser)
        handle.remove()
        outputs["tokens"] = set(tokens)
        outputs["image_tokens"] = denoiser.image_tensor_shape("image_latents", self.spec)[1]
        return outputs

    def check_parallel_outputs(
        self, name: str, layout: ParallelConfig, per_rank: list[dict[str, Any]], one_rank: dict[str, Any]
    ) -> None:
        sequence = self.spec.height // 16 * (self.spec.width // 16) + one_rank["image_tokens"]
        split = layout.ulysses_degree * layout.ring_degree
        for rank, outputs in enumerate(per_rank):
            assert outputs["tokens"] == {-(-sequence // split)}, (name, rank, outputs["tokens"])


class QwenImageEditPlusTesterConfig(QwenImageEditTesterConfig):
    """Qwen-Image-Edit-Plus: two reference images of different sizes in the sequence."""

    family = qwen_image_edit.PLUS
    spec = qwen_image_edit.PARALLEL_SPECS[qwen_image_edit.PLUS]


TESTER_CONFIGS: tuple[type[FamilyTesterConfig], ...] = (
    WanT2VTesterConfig,
    WanA14BTesterConfig,
    WanI2VTesterConfig,
    WanI2VA14BTesterConfig,
    WanTI2VTesterConfig,
    QwenImageTesterConfig,
    QwenImageEditTesterConfig,
    QwenImageEditPlusTesterConfig,
)
