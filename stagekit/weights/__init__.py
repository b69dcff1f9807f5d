"""Loading a model's safetensors weights straight into their final dtype and device, with several threads.

`load_pretrained` does the job of diffusers' and transformers' `from_pretrained` with less in between:
1. the model is built from its config with parameters on the meta device and buffers computed for real by
   `__init__`, under the requested default dtype (empty.py);
2. the safetensors headers are read and every key checked (present once, none extra, shapes equal) before
   any tensor is read (keys.py);
3. each file is mapped once (private, copy-on-write) and a thread pool faults it in while the model is built,
   then casts or moves each tensor once, straight from the mapping (reader.py);
4. the tensors are assigned with `load_state_dict(assign=True)` and tied weights re-tied (finish.py).

A rank that holds only part of a model reads only that part: with `shard_model` (tensor parallelism,
FSDP2/HSDP) each DTensor is read as this rank's slice only (sharded.py); `tensor_filter` skips whole tensors,
e.g. the blocks another pipeline stage holds. `load_stats(model)` gives what was read and how fast (stats.py).
"""

from stagekit.weights.load import load_pretrained, planned_bytes
from stagekit.weights.reader import read_safetensors
from stagekit.weights.stats import STATS_ATTR, LoadStats, ShardStats, describe, load_stats

__all__ = [
    "STATS_ATTR",
    "LoadStats",
    "ShardStats",
    "describe",
    "load_pretrained",
    "load_stats",
    "planned_bytes",
    "read_safetensors",
]
