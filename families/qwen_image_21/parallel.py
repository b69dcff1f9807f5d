"""The parallel plan of QwenImage21Transformer2DModel: `parallelize`, the layouts this family runs applied in place.

The model runs one joint [text; image] sequence with block-causal attention and a KV cache of the text, so the
sequence splits of the other image families do not apply (family.py says why). What runs:

- CFG-parallel: one guidance branch per rank of the group, each with its own KV cache; the model is unchanged.
- Tensor parallelism: each block's heads and SwiGLU feed-forward split over the tp ranks (stagekit/parallel/
  tensor_parallel.py's plan for QwenImage21Transformer2DModel); a rank caches its own heads' keys and values.
- HSDP: one fully_shard group per QwenImage21TransformerBlock (its `_repeated_blocks`) and one for the rest
  (stagekit/parallel/hsdp.py). The cache holds activations, not weights, so it is the same whether a block's
  weights were gathered for the call or held whole. The plan is applied to the empty model and each rank reads
  only its shards (families/qwen_image_21/denoise.py).
"""

from __future__ import annotations

import torch
from diffusers import QwenImage21Transformer2DModel
from torch.distributed.device_mesh import DeviceMesh

from families.qwen_image_21.family import QWEN_IMAGE_21
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods
from stagekit.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a QwenImage21Transformer2DModel in place, innermost first: TP, then HSDP
    (CFG-parallel needs no change).

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, QWEN_IMAGE_21)
    if not isinstance(transformer, QwenImage21Transformer2DModel):
        raise TypeError(f"expected QwenImage21Transformer2DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
