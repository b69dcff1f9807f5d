"""LoRA adapters on the DiT (dit_svc/lora/): equal to one rank under sequence and CFG parallelism (each family's
one-rank check against diffusers' load_lora_weights and set_adapters is LoRATesterMixin's, in
tests/integration/test_family_features.py), fused at startup equal to applied per request; the
cache's eviction; every kind of bad adapter refused by name while the stage keeps serving; the options
adapters cannot follow refused at startup."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import diffusers
import pytest
import safetensors.torch
import torch
from diffusers import WanPipeline
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import HookRegistry

from dit_svc.config import DenoiserBuild, DitConfig
from dit_svc.denoise import batch_key, denoise_batch_request, denoise_request, make_adapter_cache
from dit_svc.group import DenoiserGroup
from dit_svc.lora import AdapterError, LoraSettings, served_model_id
from dit_svc.model_options import ModelOptions
from families.qwen_image.denoise import QwenImageDenoiser
from families.wan.denoise import WanDenoiser
from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.errors import NotFoundError
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks
from tests.helpers.feature_mixins import TESTER_CONFIGS
from tests.helpers.feature_mixins.base import checkpoint
from tests.helpers.feature_mixins.lora import CASES, PARALLEL_CASES, lora_dir, one_rank_runs, rank_runs
from tests.helpers.lora_adapters import qwen_adapter, wan_adapter
from tests.helpers.serving import parse_serve

CPU = torch.device("cpu")
TOLERANCE = 1e-4
WAN_SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=1)
# 48x80 packs into 15 image tokens, which 2 does not divide (padded and masked under Ulysses).
QWEN_SPEC = DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=4, guidance_scale=4.0, seed=1)


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    name: str
    pipeline: str
    denoiser: type
    adapter: object
    spec: DenoiseSpec


FAMILY_CASES = {
    "wan": FamilyCase("wan", "WanPipeline", WanDenoiser, wan_adapter, WAN_SPEC),
    "qwen": FamilyCase("qwen", "QwenImagePipeline", QwenImageDenoiser, qwen_adapter, QWEN_SPEC),
}


def _conditioning(case: FamilyCase, text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    conditioning = {
        "prompt_embeds": torch.randn(1, 7, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 5, text_dim, generator=generator),
    }
    if case.name == "qwen":
        conditioning["prompt_embeds_mask"] = torch.ones(1, 7, dtype=torch.int64)
        conditioning["negative_prompt_embeds_mask"] = torch.ones(1, 5, dtype=torch.int64)
    return conditioning


def _options(case: FamilyCase, lora_dir: Path, **settings) -> ModelOptions:
    return ModelOptions(lora=LoraSettings(directory=lora_dir, pipeline=case.pipeline, **settings))


def _adapters(case: FamilyCase, model_dir: Path, lora_dir: Path) -> Path:
    for seed, name in enumerate(("a", "b")):
        case.adapter(model_dir, lora_dir / f"{name}.safetensors", seed=seed)
    return lora_dir


def _denoise(denoiser, adapters, case: FamilyCase, loras, **options) -> torch.Tensor:
    spec = dataclasses.replace(case.spec, loras=loras, **options)
    conditioning = _conditioning(case, denoiser.text_dim)
    latents, _ = denoise_request(denoiser, spec, conditioning, lambda s, t: None, lambda: False, adapters=adapters)
    return latents


def _reference_latents(case: FamilyCase, pipe, text_dim: int) -> torch.Tensor:
    """The pipeline's latents for the case's request and conditioning, with whatever adapters it has set."""
    pipe.set_progress_bar_config(disable=True)
    conditioning = _conditioning(case, text_dim)
    spec = case.spec
    common = dict(
        height=spec.height,
        width=spec.width,
        num_inference_steps=spec.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="latent",
        prompt_embeds=conditioning["prompt_embeds"],
        negative_prompt_embeds=conditioning["negative_prompt_embeds"],
    )
    if case.name == "wan":
        return pipe(num_frames=spec.num_frames, guidance_scale=spec.guidance_scale, **common).frames
    packed = pipe(
        true_cfg_scale=spec.guidance_scale,
        prompt_embeds_mask=conditioning["prompt_embeds_mask"],
        negative_prompt_embeds_mask=conditioning["negative_prompt_embeds_mask"],
        **common,
    ).images
    return diffusers.QwenImagePipeline._unpack_latents(packed, spec.height, spec.width, pipe.vae_scale_factor)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    actual = actual.reshape(expected.shape)
    assert (actual - expected).abs().max().item() <= TOLERANCE, (actual - expected).abs().max().item()


# The tester configs whose adapters run under parallel layouts: all of them in one spawn of two ranks.
LORA_CONFIGS = [config for config in TESTER_CONFIGS if config.lora_layouts]


def test_adapters_under_parallel_layouts_equal_one_rank(request: pytest.FixtureRequest) -> None:
    """Two adapters at different scales, then none, under each LoRA tester config's `lora_layouts` (Wan:
    ulysses2, ring2 and cfg2; Qwen-Image: ulysses2): every rank's latents equal one rank's
    (LoRATesterMixin's run, tests/helpers/feature_mixins/lora.py)."""
    cases, expected = [], {}
    for config_class in LORA_CONFIGS:
        config = config_class()
        model_dir = checkpoint(config, request)
        directory = lora_dir(config, model_dir, request)
        one_rank = one_rank_runs(config, model_dir, directory)
        expected[config.family] = [one_rank.results[index] for index in PARALLEL_CASES]
        cases.append((config_class, str(model_dir), str(directory)))
    assert {config.family for config in LORA_CONFIGS} >= {"wan-t2v", "qwen-image"}
    per_rank = run_ranks(rank_runs, 2, cases)
    for rank, families in enumerate(per_rank):
        for family, layouts in families.items():
            for layout, latents in layouts.items():
                for index, got, want in zip(PARALLEL_CASES, latents, expected[family], strict=True):
                    difference = (got - want).abs().max().item()
                    print(f"{family} {layout} rank {rank} {CASES[index]}: max abs diff {difference:.2e}")
                    assert difference <= TOLERANCE, (family, layout, rank, CASES[index], difference)


def test_adapters_with_a_step_cache_equal_diffusers_hooks(tiny_model, tmp_path) -> None:
    """An adapter and the first-block cache together: as diffusers' hook on the transformer with its layers."""
    case = FAMILY_CASES["wan"]
    lora_dir = _adapters(case, tiny_model, tmp_path)
    options = _options(case, lora_dir)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    loras = (("a", 0.7),)
    latents = _denoise(denoiser, adapters, case, loras, cache=CacheSpec("first_block", 0.2))
    with adapters.applied(loras):
        apply_first_block_cache(denoiser.transformer, FirstBlockCacheConfig(threshold=0.2))
        try:
            reference = _denoise(denoiser, None, case, ())
        finally:
            registry = HookRegistry.check_if_exists_or_initialize(denoiser.transformer)
            registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
            registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
    assert torch.equal(latents, reference)
    assert not torch.equal(latents, _denoise(denoiser, adapters, case, loras)), "the cache skipped nothing"


def test_requests_share_a_batch_only_with_the_same_adapters(tiny_model, tmp_path) -> None:
    """Batch keys differ for different adapters or scales; a batch of two requests with the same adapter (other
    seeds and prompts) gives each its own run's latents."""
    case = FAMILY_CASES["wan"]
    lora_dir = _adapters(case, tiny_model, tmp_path)
    options = _options(case, lora_dir)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    specs = [dataclasses.replace(WAN_SPEC, seed=seed, loras=(("a", 0.7),)) for seed in (1, 2)]
    conditionings = [_conditioning(case, denoiser.text_dim), _conditioning(case, denoiser.text_dim)]
    conditionings[1]["prompt_embeds"] = conditionings[1]["prompt_embeds"] * -1.0
    alone = [
        denoise_request(denoiser, spec, cond, lambda s, t: None, lambda: False, adapters=adapters)[0]
        for spec, cond in zip(specs, conditionings, strict=True)
    ]
    batched = denoise_batch_request(denoiser, specs, conditionings, lambda *_: None, lambda: [True, True], adapters)
    for (latents, _), expected in zip(batched, alone, strict=True):
        assert (latents - expected).abs().max().item() <= TOLERANCE
    assert not torch.equal(alone[0], _denoise(denoiser, adapters, case, ())), "the adapter applied in the batch"
    conditioning = {"prompt_embeds": torch.zeros(1, 7, 16)}
    keys = [
        batch_key(dataclasses.replace(WAN_SPEC, loras=loras), conditioning)
        for loras in ((), (("a", 1.0),), (("a", 0.5),), (("b", 1.0),), (("a", 1.0), ("b", 1.0)))
    ]
    assert len(set(keys)) == len(keys)
    assert batch_key(dataclasses.replace(WAN_SPEC, loras=(("a", 1.0),), seed=5), conditioning) == keys[1]


def test_fused_adapter_equals_the_adapter_per_request(tiny_model, qwen_model, tmp_path) -> None:
    """--lora a:0.7 fuses the adapter into the weights: the same latents as applying it per request at 0.7, with
    no LoRA layer left in the transformer; the fused model is served under its own id."""
    for family, model_dir in (("wan", tiny_model), ("qwen", qwen_model)):
        case = FAMILY_CASES[family]
        lora_dir = _adapters(case, model_dir, tmp_path / family)
        options = _options(case, lora_dir)
        denoiser = case.denoiser(model_dir, CPU, torch.float32, options=options)
        expected = _denoise(denoiser, make_adapter_cache(denoiser, options), case, (("a", 0.7),))
        fused_options = _options(case, lora_dir, fused=(("a", 0.7),), max_per_request=0)
        fused = case.denoiser(model_dir, CPU, torch.float32, options=fused_options)
        assert make_adapter_cache(fused, fused_options) is None
        assert not any("lora" in name for name, _ in fused.transformer.named_parameters())
        assert (_denoise(fused, None, case, ()) - expected).abs().max().item() <= TOLERANCE, family
    assert served_model_id("tiny", (("a", 0.7), ("acme/b", 1.0))) == "tiny+a:0.7+acme-b"


def _community_adapter(model_dir: Path, path: Path, alpha: torch.Tensor) -> Path:
    """An adapter in the original Wan trainers' layout ("diffusion_model." keys, lora_down/lora_up, an alpha per
    layer), which diffusers' Wan loader converts."""
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    width = config["num_attention_heads"] * config["attention_head_dim"]
    generator = torch.Generator().manual_seed(7)
    state = {}
    for block in range(config["num_layers"]):
        for layer in ("self_attn.q", "self_attn.v", "cross_attn.k", "ffn.0"):
            out = config["ffn_dim"] if layer == "ffn.0" else width
            prefix = f"diffusion_model.blocks.{block}.{layer}"
            state[f"{prefix}.lora_down.weight"] = torch.randn(4, width, generator=generator) * 0.3
            state[f"{prefix}.lora_up.weight"] = torch.randn(out, 4, generator=generator) * 0.3
            state[f"{prefix}.alpha"] = alpha.clone()
    safetensors.torch.save_file(state, str(path))
    return path


def test_a_community_format_adapter_equals_diffusers_conversion(tiny_model, tmp_path) -> None:
    """A file in the original Wan layout is read through WanPipeline's own converter: the latents equal the
    pipeline's with load_lora_weights of the same file."""
    case = FAMILY_CASES["wan"]
    _community_adapter(tiny_model, tmp_path / "a.safetensors", torch.tensor(8.0))
    options = _options(case, tmp_path)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    latents = _denoise(denoiser, adapters, case, (("a", 0.8),))
    assert (latents - _denoise(denoiser, adapters, case, ())).abs().max() > 1e-2
    pipe = WanPipeline.from_pretrained(tiny_model)
    pipe.load_lora_weights(str(tmp_path / "a.safetensors"), adapter_name="a")
    pipe.set_adapters(["a"], [0.8])
    expected = _reference_latents(case, pipe, denoiser.text_dim)
    _close(latents, expected)


def test_the_cache_evicts_the_least_recently_used_adapter_beyond_its_bytes(tiny_model, tmp_path) -> None:
    case = FAMILY_CASES["wan"]
    for seed, name in enumerate(("a", "b", "c")):
        wan_adapter(tiny_model, tmp_path / f"{name}.safetensors", seed=seed)
    probe = WanDenoiser(tiny_model, CPU, torch.float32, options=_options(case, tmp_path))
    one = make_adapter_cache(probe, _options(case, tmp_path))
    one.prepare((("a", 1.0),))
    size = one.loaded_bytes
    options = _options(case, tmp_path, cache_bytes=2 * size)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    expected_c = _denoise(denoiser, adapters, case, (("c", 1.0),))
    for name in ("a", "b", "a", "c"):
        adapters.prepare(((name, 1.0),))
    assert list(adapters.loaded) == ["a", "c"], "b was the least recently used"
    assert adapters.loaded_bytes <= 2 * size
    assert (adapters.hits, adapters.misses) == (1, 4)
    assert torch.equal(_denoise(denoiser, adapters, case, (("c", 1.0),)), expected_c)
    with pytest.raises(AdapterError, match="--lora-cache-bytes"):
        adapters.prepare((("a", 1.0), ("b", 1.0), ("c", 1.0)))
    assert list(adapters.loaded) == ["a", "c"], "a refused request loads and evicts nothing"


def test_a_replaced_adapter_file_is_read_again(tiny_model, tmp_path) -> None:
    case = FAMILY_CASES["wan"]
    options = _options(case, tmp_path)
    wan_adapter(tiny_model, tmp_path / "a.safetensors", seed=0)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    first = _denoise(denoiser, adapters, case, (("a", 1.0),))
    wan_adapter(tiny_model, tmp_path / "a.safetensors", seed=1)
    second = _denoise(denoiser, adapters, case, (("a", 1.0),))
    fresh = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    assert not torch.equal(first, second)
    assert torch.equal(second, _denoise(fresh, make_adapter_cache(fresh, options), case, (("a", 1.0),)))


def _bad_adapters(model_dir: Path, directory: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, words its refusal names)."""
    good = safetensors.torch.load_file(wan_adapter(model_dir, directory / "good.safetensors", seed=0))
    with safetensors.safe_open(str(directory / "good.safetensors"), framework="pt") as handle:
        header = handle.metadata()
    key_a = "transformer.blocks.0.attn1.to_q.lora_A.weight"
    cases = {
        "nomatch": ({key.replace("blocks.", "layers."): value for key, value in good.items()}, header, "match no"),
        "shapes": ({**good, key_a: torch.zeros(4, 17)}, header, "to_q"),
        "nan": ({**good, key_a: torch.full_like(good[key_a], float("nan"))}, header, "NaN"),
        "rank": (good, {**header, "lora_adapter_metadata": json.dumps({"r": "four", "lora_alpha": 8})}, "r"),
        "alpha": (good, {**header, "lora_adapter_metadata": "{not json"}, "not JSON"),
        "unpaired": ({k: v for k, v in good.items() if "lora_B" not in k or "attn1.to_q" not in k}, header, "pair"),
    }
    files = {}
    for name, (state, metadata, words) in cases.items():
        path = directory / f"{name}.safetensors"
        safetensors.torch.save_file(state, str(path), metadata=metadata)
        files[name] = (path, words)
    _community_adapter(model_dir, directory / "alpha_vector.safetensors", torch.ones(3))
    files["alpha_vector"] = (directory / "alpha_vector.safetensors", "cannot read it")
    (directory / "truncated.safetensors").write_bytes((directory / "good.safetensors").read_bytes()[:100])
    files["truncated"] = (directory / "truncated.safetensors", "not a readable safetensors file")
    files["big"] = (directory / "big.safetensors", "at most 1000")
    (directory / "big.safetensors").write_bytes((directory / "good.safetensors").read_bytes())
    return files


def test_bad_adapters_are_refused_by_name_and_the_stage_keeps_serving(tiny_model, tmp_path) -> None:
    """Keys that match no layer, wrong shapes, NaN, a rank or alpha that does not parse (in the header, or an
    alpha tensor that is not a number), a lone lora_A, a truncated file, a file over the size limit: each
    refused naming the adapter and what is wrong; nothing is loaded, and the next requests are right."""
    case = FAMILY_CASES["wan"]
    bad = _bad_adapters(tiny_model, tmp_path)
    options = _options(case, tmp_path)
    denoiser = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    adapters = make_adapter_cache(denoiser, options)
    base = _denoise(denoiser, adapters, case, ())
    good = _denoise(denoiser, adapters, case, (("good", 1.0),))
    small = make_adapter_cache(denoiser, _options(case, tmp_path, max_file_bytes=1000))
    for name, (_, words) in bad.items():
        cache = small if name == "big" else adapters
        with pytest.raises(AdapterError) as error:
            cache.check(((name, 1.0),))
        assert f"lora '{name}'" in str(error.value) and words in str(error.value), str(error.value)
    with pytest.raises(NotFoundError, match="lora 'absent'"):
        adapters.check((("absent", 1.0),))
    assert list(adapters.loaded) == ["good"]
    assert torch.equal(_denoise(denoiser, adapters, case, (("good", 1.0),)), good)
    assert torch.equal(_denoise(denoiser, adapters, case, ()), base)


def test_a_bad_adapter_fails_only_its_request_in_a_rank_group(tiny_model, tmp_path) -> None:
    """Rank 0 checks the adapter before the group runs: a bad one is refused and the group keeps serving, equal
    to one rank with a good adapter after."""
    case = FAMILY_CASES["wan"]
    lora_dir = _adapters(case, tiny_model, tmp_path)
    (lora_dir / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    options = _options(case, lora_dir)
    one = WanDenoiser(tiny_model, CPU, torch.float32, options=options)
    expected = _denoise(one, make_adapter_cache(one, options), case, (("a", 0.7),))
    group = DenoiserGroup(tiny_model, CPU, torch.float32, 1, DenoiserBuild(ParallelConfig(ulysses_degree=2), options))
    try:
        conditioning = _conditioning(case, group.text_dim)
        spec = dataclasses.replace(WAN_SPEC, loras=(("broken", 1.0),))
        with pytest.raises(AdapterError, match="lora 'broken'"):
            group.denoise_request(spec, conditioning, lambda s, t: None, lambda: False)
        assert group.failure() is None
        spec = dataclasses.replace(WAN_SPEC, loras=(("a", 0.7),))
        latents, _ = group.denoise_request(spec, conditioning, lambda s, t: None, lambda: False)
        assert (latents - expected).abs().max().item() <= TOLERANCE
    finally:
        group.close()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tensor-parallel-size", "2"], "tensor-parallel-size"),
        (["--use-hsdp", "--ulysses-degree", "2"], "use-hsdp"),
        (["--quantization", "fp8"], "quantization fp8"),
        (["--quantization", "int8"], "quantization int8"),
        (["--enable-cpu-offload"], "enable-cpu-offload"),
        (["--enable-layerwise-offload"], "enable-layerwise-offload"),
        (["--compile"], "--compile"),
        (["--lora", "a", "--tensor-parallel-size", "2", "--max-loras-per-request", "0"], "--lora cannot"),
        (["--max-loras-per-request", "17"], "allowed 0"),
        (["--lora-cache-bytes", "0"], "at least 1"),
        (["--lora", "a:big"], "not a number"),
    ],
)
def test_adapters_per_request_are_refused_with_options_they_cannot_follow(tiny_model, tmp_path, flags, words) -> None:
    args = parse_serve(["dit", "--model", str(tiny_model), "--lora-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=words):
        DitConfig.from_args(args)


def test_adapters_are_refused_at_startup_where_unverified(a14b_model, tmp_path) -> None:
    """A family whose pipeline's LoRA loading is not verified against ours refuses --lora-dir and --lora; one that
    is accepts them, and --lora without --lora-dir is refused."""
    for flags in (["--lora-dir", str(tmp_path)], ["--lora-dir", str(tmp_path), "--lora", "a"]):
        with pytest.raises(SystemExit, match="wan2.2-a14b family does not support"):
            DitConfig.from_args(parse_serve(["dit", "--model", str(a14b_model), *flags]))
    with pytest.raises(SystemExit, match="--lora needs --lora-dir"):
        DitConfig.from_args(parse_serve(["dit", "--model", str(a14b_model), "--lora", "a"]))
    with pytest.raises(SystemExit, match="not a directory"):
        DitConfig.from_args(parse_serve(["dit", "--model", str(a14b_model), "--lora-dir", str(tmp_path / "none")]))
