"""LTX-2: the family's text encoder and joint audio-video denoising loop against LTX2Pipeline, on tiny checkpoints in
both published layouts ("tiny": LTX-2.3's, "tiny-2.0": LTX-2.0's, families/ltx2/init_model.py).

The text encoder's tensors equal the pipeline's `encode_prompt` followed by its connectors call; the denoiser's
video and audio latents equal `LTX2Pipeline(output_type="latent")`'s from the same prompt embeddings and seed, at
the pipeline's default guidance (CFG, STG, modality guidance, rescale), with STG on a block the tiny transformer
has, at guidance_scale 1 (which turns off only the video's CFG term: the audio's CFG still runs the negative
prompt) and with every guidance off; the audio latents decode (audio VAE, vocoder) to the pipeline's waveform, of
the sample rate and length the configs give.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline

from families.ltx2.checkpoint import read_geometry
from families.ltx2.denoise import LTX2Denoiser
from families.ltx2.encode import LTX2PromptEncoder
from families.ltx2.family import LTX2
from families.ltx2.guidance import LTX2Guidance
from families.ltx2.init_model import write_checkpoint
from families.ltx2.parallel import parallelize
from stagekit.denoise import DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.mesh import ParallelConfigError

CPU = torch.device("cpu")
PROMPT = "A red fox trots across a snowy field at dawn, its breath rising in small white clouds"
NEGATIVE = "worst quality, inconsistent motion, blurry, jittery, distorted"
MAX_SEQUENCE_LENGTH = 1024
# 64x96 pixels: 2x3 latents; 17 frames: 3 latent frames, and at 24 fps 18 audio latent frames.
SPEC = DenoiseSpec(height=64, width=96, num_frames=17, num_inference_steps=3, guidance_scale=3.0, seed=7)
FRAME_RATE = 24.0
TOLERANCE = 1e-5
# Each layout's vocoder: (class, samples per mel frame at its output rate, output sample rate).
VOCODERS = {"tiny": ("LTX2VocoderWithBWE", 160 * 3, 48_000), "tiny-2.0": ("LTX2Vocoder", 240, 24_000)}


@pytest.fixture(scope="module", params=["tiny", "tiny-2.0"])
def preset(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(preset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"ltx2-{preset}")
    with torch.random.fork_rng(devices=[]):
        write_checkpoint(LTX2, out, preset, 0, {})
    return out


@pytest.fixture(scope="module")
def pipeline(model: Path) -> LTX2Pipeline:
    pipeline = LTX2Pipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def encoder(model: Path) -> LTX2PromptEncoder:
    return LTX2PromptEncoder(model, "ltx-2-tiny", CPU, torch.float32)


@pytest.fixture(scope="module")
def conditioning(encoder: LTX2PromptEncoder) -> dict[str, torch.Tensor]:
    """The text encoder's tensors for the prompt and the negative prompt, as the DiT stage receives them."""
    tensors, _ = encoder.encode([PROMPT, NEGATIVE], MAX_SEQUENCE_LENGTH)
    return {
        f"{role}_{name}": tensor[index : index + 1]
        for index, role in enumerate(("prompt", "negative_prompt"))
        for name, tensor in tensors.items()
    }


@pytest.fixture(scope="module")
def gemma_embeds(pipeline: LTX2Pipeline) -> dict[str, torch.Tensor]:
    """The pipeline's own prompt embeddings (Gemma's stacked hidden states, before the connectors) with masks."""
    embeds, mask, negative, negative_mask = pipeline.encode_prompt(
        PROMPT, NEGATIVE, do_classifier_free_guidance=True, max_sequence_length=MAX_SEQUENCE_LENGTH, device=CPU
    )
    return {
        "prompt_embeds": embeds,
        "prompt_attention_mask": mask,
        "negative_prompt_embeds": negative,
        "negative_prompt_attention_mask": negative_mask,
    }


def test_encoder_equals_pipeline_encode_prompt_and_connectors(
    pipeline: LTX2Pipeline, gemma_embeds: dict[str, torch.Tensor], conditioning: dict[str, torch.Tensor]
) -> None:
    """The connectors' video and audio embeddings and mask, as LTX2Pipeline.__call__ makes them from encode_prompt:
    the negative and positive prompt in one batch, with the tokenizer's (left) padding side."""
    assert pipeline.tokenizer.padding_side == "left"
    video, audio, mask = pipeline.connectors(
        torch.cat([gemma_embeds["negative_prompt_embeds"], gemma_embeds["prompt_embeds"]]),
        torch.cat([gemma_embeds["negative_prompt_attention_mask"], gemma_embeds["prompt_attention_mask"]]),
        padding_side=pipeline.tokenizer.padding_side,
    )
    for row, role in ((1, "prompt"), (0, "negative_prompt")):
        ours = conditioning[f"{role}_video_embeds"], conditioning[f"{role}_audio_embeds"]
        theirs = video[row : row + 1], audio[row : row + 1]
        assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape, role
        differences = [(mine - expected).abs().max().item() for mine, expected in zip(ours, theirs, strict=True)]
        print(f"{role}: video embeds max abs diff {differences[0]:.2e}, audio embeds {differences[1]:.2e}")
        assert max(differences) <= TOLERANCE and theirs[0].abs().max() > 0.1, role
        assert conditioning[f"{role}_embeds_mask"].dtype == torch.int64
        assert torch.equal(conditioning[f"{role}_embeds_mask"], mask[row : row + 1])
    # Gemma saw the prompts' own tokens only, left-padded to 1024; the registers fill the rest, so every position is
    # attended.
    real = int(gemma_embeds["prompt_attention_mask"].sum())
    assert 1 < real < MAX_SEQUENCE_LENGTH and bool(gemma_embeds["prompt_attention_mask"][0, -real:].all())
    assert conditioning["prompt_video_embeds"].shape[1] == MAX_SEQUENCE_LENGTH
    assert bool(conditioning["prompt_embeds_mask"].all())


def test_long_prompt_is_cut_as_the_pipeline_cuts_it(encoder: LTX2PromptEncoder, pipeline: LTX2Pipeline) -> None:
    """Past 1024 tokens (<bos> counted) the text is cut there, as the pipeline's tokenizer call cuts it."""
    long_prompt = " ".join([PROMPT] * 80)
    truncation = encoder.truncation(long_prompt, MAX_SEQUENCE_LENGTH)
    assert truncation is not None and truncation.kept == MAX_SEQUENCE_LENGTH and truncation.given > 1024
    assert encoder.truncation(PROMPT, MAX_SEQUENCE_LENGTH) is None
    embedding, _ = encoder.encode_one(long_prompt, MAX_SEQUENCE_LENGTH)
    embeds, mask, _, _ = pipeline.encode_prompt(
        long_prompt, do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH, device=CPU
    )
    assert bool(mask.all())
    video, audio, _ = pipeline.connectors(embeds, mask, padding_side="left")
    assert (embedding["video_embeds"] - video[0]).abs().max() <= TOLERANCE
    assert (embedding["audio_embeds"] - audio[0]).abs().max() <= TOLERANCE


def _pipeline_latents(
    pipeline: LTX2Pipeline, gemma_embeds: dict[str, torch.Tensor], spec: DenoiseSpec, guidance: LTX2Guidance
) -> tuple[torch.Tensor, torch.Tensor]:
    """LTX2Pipeline's (video, audio) latents from its prompt embeddings, the seed's generator and `guidance` (its own
    defaults, left unsaid, where `guidance` is LTX2Guidance's defaults)."""
    arguments = {} if guidance == LTX2Guidance() else _guidance_arguments(guidance)
    output = pipeline(
        **gemma_embeds,
        **arguments,
        height=spec.height,
        width=spec.width,
        num_frames=spec.num_frames,
        frame_rate=FRAME_RATE,
        num_inference_steps=spec.num_inference_steps,
        guidance_scale=spec.guidance_scale,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="latent",
    )
    return output.frames, output.audio


def _guidance_arguments(guidance: LTX2Guidance) -> dict[str, object]:
    """LTX2Pipeline's keyword arguments for `guidance`."""
    return dict(
        stg_scale=guidance.stg_scale,
        modality_scale=guidance.modality_scale,
        guidance_rescale=guidance.guidance_rescale,
        audio_guidance_scale=guidance.audio_guidance_scale,
        audio_stg_scale=guidance.audio_stg_scale,
        audio_modality_scale=guidance.audio_modality_scale,
        audio_guidance_rescale=guidance.audio_guidance_rescale,
        spatio_temporal_guidance_blocks=list(guidance.stg_blocks),
        use_cross_timestep=guidance.use_cross_timestep,
        motion_speed=guidance.motion_speed,
    )


def test_guidance_defaults_are_the_pipelines() -> None:
    """LTX2Guidance() is LTX2Pipeline.__call__'s defaults, and its defaults are 512x768, 30 steps, scale 3.0."""
    defaults = {
        name: parameter.default for name, parameter in inspect.signature(LTX2Pipeline.__call__).parameters.items()
    }
    for name, value in _guidance_arguments(LTX2Guidance()).items():
        assert defaults[name] == value, name
    assert (defaults["height"], defaults["width"], defaults["num_frames"]) == (512, 768, None)
    assert (defaults["num_inference_steps"], defaults["guidance_scale"], defaults["frame_rate"]) == (30, 3.0, 24.0)
    assert defaults["max_sequence_length"] == MAX_SEQUENCE_LENGTH
    assert (LTX2.defaults.height, LTX2.defaults.width, LTX2.defaults.num_inference_steps) == (512, 768, 30)


ALL_OFF = LTX2Guidance(
    stg_scale=0.0,
    modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_scale=1.0,
    audio_stg_scale=0.0,
    audio_modality_scale=1.0,
    audio_guidance_rescale=0.0,
)


@pytest.mark.parametrize(
    ("guidance_scale", "guidance", "branches"),
    [
        # The pipeline's defaults: its STG block 28 is past the tiny transformer's 2 blocks, so STG perturbs nothing.
        (3.0, LTX2Guidance(), ["cond_uncond", "uncond_stg", "uncond_modality"]),
        (3.0, LTX2Guidance(stg_blocks=(1,)), ["cond_uncond", "uncond_stg", "uncond_modality"]),
        # The video's CFG term is 0 at scale 1, but the audio's CFG (7.0) still runs the negative prompt.
        (1.0, LTX2Guidance(stg_blocks=(1,)), ["cond_uncond", "uncond_stg", "uncond_modality"]),
        (1.0, ALL_OFF, ["cond_uncond"]),
    ],
    ids=["defaults", "stg-block-1", "guidance-1", "all-off"],
)
def test_denoiser_latents_equal_pipeline(
    request: pytest.FixtureRequest,
    preset: str,
    model: Path,
    pipeline: LTX2Pipeline,
    gemma_embeds: dict[str, torch.Tensor],
    conditioning: dict[str, torch.Tensor],
    guidance_scale: float,
    guidance: LTX2Guidance,
    branches: list[str],
) -> None:
    spec = DenoiseSpec(**{**SPEC.__dict__, "guidance_scale": guidance_scale})
    expected_video, expected_audio = _pipeline_latents(pipeline, gemma_embeds, spec, guidance)
    denoiser = LTX2Denoiser(model, CPU, torch.float32, guidance=guidance)
    ran: list[str] = []
    first_step: dict[str, torch.Tensor] = {}
    original = denoiser._predict

    def recording(step: object, text: object, branch: str, **kwargs: object) -> tuple:
        velocities = original(step, text, branch, **kwargs)  # type: ignore[arg-type]
        ran.append(branch)
        # The positive prompt's video velocity (the last row of CFG's batch of negative and positive).
        first_step.setdefault(branch, velocities[0][-1:])
        return velocities

    denoiser._predict = recording  # type: ignore[method-assign]
    steps: list[tuple[int, int]] = []
    video, audio = denoiser.denoise_av(
        spec, conditioning, on_step=lambda step, total: steps.append((step, total)), cancelled=lambda: False
    )
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert ran == branches * spec.num_inference_steps
    assert video.shape == (1, 8, 3, 2, 3) and video.dtype == torch.float32
    assert audio.shape == expected_audio.shape == (1, 4, 18, 4) and audio.dtype == torch.float32
    video_difference = (video - expected_video).abs().max().item()
    audio_difference = (audio - expected_audio).abs().max().item()
    print(
        f"{request.node.name}: video latents max abs diff {video_difference:.2e}, audio latents {audio_difference:.2e}"
    )
    assert video_difference <= TOLERANCE and audio_difference <= TOLERANCE
    assert expected_video.abs().max() > 0.1 and expected_audio.abs().max() > 0.1
    if "uncond_stg" in first_step:
        # STG skips self-attention only where the block exists and the transformer perturbs it (LTX-2.3's).
        # (The positive row of CFG's batch of two and the STG pass's batch of one round apart, by at most 1e-5.)
        perturbs = preset == "tiny" and guidance.stg_blocks == (1,)
        stg_change = (first_step["uncond_stg"] - first_step["cond_uncond"]).abs().max().item()
        assert stg_change > 1e-3 if perturbs else stg_change <= TOLERANCE


def test_missing_negative_is_refused_while_cfg_runs(model: Path, conditioning: dict[str, torch.Tensor]) -> None:
    """At guidance_scale 1 the audio's CFG still needs the negative prompt."""
    denoiser = LTX2Denoiser(model, CPU, torch.float32)
    positive = {name: tensor for name, tensor in conditioning.items() if name.startswith("prompt_")}
    spec = DenoiseSpec(**{**SPEC.__dict__, "guidance_scale": 1.0})
    with pytest.raises(ValueError, match="negative_prompt_video_embeds are required"):
        denoiser.denoise_av(spec, positive, on_step=lambda step, total: None, cancelled=lambda: False)


def test_audio_latents_decode_to_the_pipelines_waveform(
    preset: str,
    model: Path,
    pipeline: LTX2Pipeline,
    gemma_embeds: dict[str, torch.Tensor],
    conditioning: dict[str, torch.Tensor],
) -> None:
    """Our audio latents through the audio VAE and the vocoder, as the pipeline ends, equal the pipeline's
    waveform: 2 channels, (4A - 3) mel frames (A audio latent frames, the audio VAE's causal 4x) at 100 a second,
    each the vocoder's samples per mel frame long, at its output sample rate."""
    output = pipeline(
        **gemma_embeds,
        height=SPEC.height,
        width=SPEC.width,
        num_frames=SPEC.num_frames,
        frame_rate=FRAME_RATE,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(SPEC.seed),
        output_type="np",
    )
    spec = DenoiseSpec(**{**SPEC.__dict__, "num_inference_steps": 2})
    _, audio_latents = LTX2Denoiser(model, CPU, torch.float32).denoise_av(
        spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False
    )
    mel = pipeline.audio_vae.decode(audio_latents, return_dict=False)[0]
    waveform = pipeline.vocoder(mel)

    vocoder_class, samples_per_mel_frame, sample_rate = VOCODERS[preset]
    audio_frames = audio_latents.shape[2]
    assert audio_frames == round(SPEC.num_frames / FRAME_RATE * 16_000 / 160 / 4) == 18
    mel_frames = 4 * audio_frames - 3
    assert mel.shape == (1, 2, mel_frames, pipeline.audio_vae.config.mel_bins)
    assert type(pipeline.vocoder).__name__ == vocoder_class
    assert pipeline.vocoder.config.output_sampling_rate == sample_rate
    assert waveform.shape == output.audio.shape == (1, 2, mel_frames * samples_per_mel_frame)
    seconds = waveform.shape[-1] / sample_rate
    assert math.isclose(seconds, mel_frames / 100)
    difference = (waveform - output.audio).abs().max().item()
    print(
        f"{preset}: waveform {tuple(waveform.shape)} at {sample_rate} Hz ({seconds:.3f} s), "
        f"max abs diff {difference:.2e}"
    )
    assert difference <= TOLERANCE and output.audio.abs().max() > 0.01
    # The frames the video latents decode to (17 of 64x96), for the audio's duration to be compared with.
    assert output.frames.shape == (1, SPEC.num_frames, SPEC.height, SPEC.width, 3)


def test_checkpoint_reader(preset: str, model: Path) -> None:
    """32x spatial and 8x temporal compression as published, 1x1x1 patches, LTX2Pipeline's defaults, and the
    vocoder's sample rate and channels (what the stages report as ModelLimits.audio_sample_rate, audio_channels)."""
    configs = {
        name: json.loads((model / name / "config.json").read_text()) for name in ("vae", "transformer", "vocoder")
    }
    geometry = read_geometry(configs)
    assert (geometry["audio_sample_rate"], geometry["audio_channels"]) == (VOCODERS[preset][2], 2)
    with pytest.raises(ValueError, match="names a vocoder"):
        read_geometry({name: config for name, config in configs.items() if name != "vocoder"})
    # A duration head (LTX-2.5's automatic length) would make the pipeline's default length differ from ours.
    index = {"duration_head": ["diffusers", "LTX2DurationHead"], "prompt_enhancer": [None, None]}
    with pytest.raises(ValueError, match="lists a duration_head"):
        read_geometry({**configs, "model_index": index})
    assert read_geometry({**configs, "model_index": {**index, "duration_head": [None, None]}}) == geometry
    assert (geometry["vae_scale_spatial"], geometry["vae_scale_temporal"]) == (32, 8)
    assert geometry["patch_size"] == (1, 1, 1) and geometry["latent_channels"] == 8
    assert geometry["max_sequence_length"] == MAX_SEQUENCE_LENGTH
    defaults = geometry["defaults"]
    assert (defaults.height, defaults.width, defaults.num_frames) == (512, 768, 121)
    assert (defaults.num_inference_steps, defaults.guidance_scale, defaults.fps) == (30, 3.0, 24.0)
    # A config without the ratios gets what AutoencoderKLLTX2Video computes: 4x4 patches, 2x per scaling block.
    computed = {key: value for key, value in configs["vae"].items() if not key.endswith("_compression_ratio")}
    computed_geometry = read_geometry({**configs, "vae": computed})
    assert (computed_geometry["vae_scale_spatial"], computed_geometry["vae_scale_temporal"]) == (64, 16)


@pytest.mark.parametrize(
    ("layout", "flag", "words"),
    [
        (ParallelConfig(ulysses_degree=2), "--ulysses-degree", "joint video and audio sequences"),
        (ParallelConfig(ring_degree=2), "--ring-degree", "joint video and audio sequences"),
        (ParallelConfig(cfg_degree=2), "--cfg-parallel-size", "CFG, STG and modality passes"),
        (ParallelConfig(tp_degree=2), "--tensor-parallel-size", "LTX2VideoTransformerBlock"),
        (ParallelConfig(ulysses_degree=2, use_hsdp=True, hsdp_shard_size=2), "--ulysses-degree", "audio sequences"),
    ],
)
def test_parallel_plan_is_hsdp_alone(layout: ParallelConfig, flag: str, words: str) -> None:
    """The family's `parallelize` refuses every method but HSDP, with the family's reason and naming HSDP as what it
    runs, before it touches the model or the mesh."""
    with pytest.raises(ParallelConfigError) as raised:
        parallelize(torch.nn.Linear(1, 1), layout, None, torch.device("cpu"))  # type: ignore[arg-type]
    message = str(raised.value)
    assert flag in message and words in message and "it runs --use-hsdp" in message, message
