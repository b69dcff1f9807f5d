"""Qwen-Image: the checks its tester config does not cover, on the Qwen components.

Offload, quantization and the DiT's loading run from QwenImageTesterConfig (tests/integration/
test_family_features.py); here: the DiT's startup check of `--ignored-layers` against Qwen's layer names, and
loading compared between `stagekit.weights.load_pretrained` and each library's `from_pretrained`, and between
the Qwen text-encoder and VAE stages and QwenImagePipeline's components.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLForConditionalGeneration

from dit_svc.model_options import ModelOptions
from families.init_model import init_model
from families.qwen_image.decode import QwenImageDecoder
from families.qwen_image.encode import QwenPromptEncoder
from stagekit.weights import load_pretrained, load_stats
from tests.helpers.feature_mixins import QwenImageTesterConfig, assert_same_tensors

CPU = torch.device("cpu")
IGNORED = QwenImageTesterConfig.ignored_layers
COMPONENTS = {
    "transformer": QwenImageTransformer2DModel,
    "vae": AutoencoderKLQwenImage,
    "text_encoder": Qwen2_5_VLForConditionalGeneration,
}


def test_qwen_ignored_layers_are_checked_against_qwen_layer_names(qwen_model: Path) -> None:
    """The DiT's startup check reads QwenImage's own layer names: Wan's `blocks.*` matches nothing there."""
    from dit_svc.config import DitConfig
    from tests.helpers.serving import parse_serve

    flags = ["dit", "--model", str(qwen_model), "--quantization", "int8", "--ignored-layers"]
    options = DitConfig.from_args(parse_serve([*flags, ",".join(IGNORED)])).options
    assert options == ModelOptions("int8", IGNORED, None, 1)
    with pytest.raises(SystemExit) as raised:
        DitConfig.from_args(parse_serve([*flags, "blocks.0.*"]))
    message = str(raised.value)
    assert "pattern 'blocks.0.*' matches no linear layer" in message and "img_in" in message, message


# ------------------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def sharded_qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        "qwen-image", "tiny", tmp_path_factory.mktemp("models") / "qwen-sharded", seed=0, shard_size=50_000
    )


def _reference(name: str, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    kwargs = {"dtype": dtype} if name == "text_encoder" else {"torch_dtype": dtype}
    return COMPONENTS[name].from_pretrained(directory, **kwargs).eval()


@torch.no_grad()
def _forward(name: str, model: torch.nn.Module) -> torch.Tensor:
    """One deterministic forward pass of a component, in the model's dtype."""
    generator = torch.Generator().manual_seed(0)
    dtype = model.dtype
    if name == "transformer":
        config = model.config
        return model(
            hidden_states=torch.randn(1, 12, config.in_channels, generator=generator).to(dtype),
            encoder_hidden_states=torch.randn(1, 6, config.joint_attention_dim, generator=generator).to(dtype),
            encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 0, 1]]),
            timestep=torch.tensor([0.5]).to(dtype),
            img_shapes=[[(1, 3, 4)]],
            return_dict=False,
        )[0]
    if name == "vae":
        return model.decode(torch.randn(1, model.config.z_dim, 1, 4, 4, generator=generator).to(dtype)).sample
    ids = torch.randint(3, 1000, (1, 9), generator=generator)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 4])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_qwen_components_load_like_from_pretrained(
    sharded_qwen_model: Path, name: str, num_threads: int, dtype: torch.dtype
) -> None:
    directory = sharded_qwen_model / name
    shards = len(list(directory.glob("*.safetensors")))
    assert shards >= 3, f"{name}: the checkpoint should be sharded ({shards} files)"
    reference = _reference(name, directory, dtype)
    ours = load_pretrained(COMPONENTS[name], directory, dtype=dtype, num_threads=num_threads)
    assert type(ours) is COMPONENTS[name] and not ours.training
    assert_same_tensors(ours, reference, name)
    assert torch.equal(_forward(name, ours), _forward(name, reference)), name
    stats = load_stats(ours)
    print(f"{name} {dtype} {num_threads} thread(s): {stats.tensors} tensors from {len(stats.shards)} shards")
    assert stats.threads == num_threads and len(stats.shards) == shards


def test_qwen_stages_read_weights_with_their_load_threads(qwen_model: Path, qwen_pipeline) -> None:
    """The text-encoder and VAE stages read their component with the stage's thread count and hold the
    pipeline's weights (the DiT's: TestQwenImageLoading)."""
    encoder = QwenPromptEncoder(qwen_model, "qwen", CPU, torch.float32, load_threads=3)
    decoder = QwenImageDecoder(qwen_model, CPU, torch.float32, load_threads=2)
    for name, model, threads in (("text_encoder", encoder.text_encoder, 3), ("vae", decoder.vae, 2)):
        assert load_stats(model).threads == threads, name
        assert_same_tensors(model, getattr(qwen_pipeline, name), name)

    embedding, cached = encoder.encode_one("a red fox in the snow", 512)
    expected, mask = qwen_pipeline.encode_prompt("a red fox in the snow", device=CPU)
    assert not cached and mask is None  # one text alone: no padding, as the pipeline leaves it
    assert torch.equal(embedding, expected[0])
