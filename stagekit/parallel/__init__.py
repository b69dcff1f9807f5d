"""The generic machinery that splits one request's denoising across a process group.

`ParallelConfig` holds the degrees from the command line and `build_mesh` lays them out as one DeviceMesh.
The functions that apply one method to a model live beside this file (sequence_parallel.py executes a
model's `_cp_plan` with our attention; tensor_parallel.py, hsdp.py, cfg.py); each family composes them in
its own `parallelize` (families/<family>/parallel.py), torchtitan-style.
"""

from __future__ import annotations

from stagekit.parallel.mesh import ParallelConfig, ParallelConfigError, build_hsdp_mesh, build_mesh, device_type_for

__all__ = ["ParallelConfig", "ParallelConfigError", "build_hsdp_mesh", "build_mesh", "device_type_for"]
