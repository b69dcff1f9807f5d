"""The parallel plan of LTX2VideoTransformer3DModel: HSDP only.

HSDP wraps the transformer (stagekit/parallel/hsdp.py): one fully_shard group per LTX2VideoTransformerBlock (the
class its `_repeated_blocks` names, each block holding both the video and the audio stream and their cross-modal
attention) and one for the rest (the patch and caption projections, the timestep embeddings and both output
layers). Each rank keeps its shards and gathers one block's full weights just before the block runs, so the video
and audio latents are the unsharded model's. The plan is applied to the empty model and each rank reads only its
shards (stagekit/parallel/load.py). Every rank runs every pass of a step (the CFG batch, the STG pass and the
modality-isolated pass) over the whole joint sequence, as one rank does.

The other methods are refused with the family's reasons (families/ltx2/family.py): sequence parallelism has no plan
for the joint video and audio sequences, CFG-parallel none for the passes beside CFG's, and tensor parallelism none
for LTX2VideoTransformerBlock.
"""

from __future__ import annotations

import torch
from diffusers import LTX2VideoTransformer3DModel
from torch.distributed.device_mesh import DeviceMesh

from families.ltx2.family import LTX2
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout (HSDP, the only method the family runs) to an LTX2VideoTransformer3DModel in place.

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, LTX2)
    if not isinstance(transformer, LTX2VideoTransformer3DModel):
        raise TypeError(f"expected LTX2VideoTransformer3DModel, not {type(transformer).__name__}")
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
