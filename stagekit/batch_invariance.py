"""Batched passes whose rows equal their passes alone, bit for bit.

A transformer pass over several requests' rows computes most of its work as matrix products whose rows do not
depend on one another: a linear layer over [B, tokens, D] is one product of B x tokens rows, and the kernels give
each row the bits it gets alone (measured on the CPU kernels for every token count the families use). Two kinds of
layer are not: those fed one vector per request (the timestep embedding's MLP, the adaptive norms' modulation:
[B, D]), which alone are a matrix-vector product and in a batch a matrix product summed in another order, and
convolutions (Wan's 3D patch embedding), whose kernel choice depends on the batch. Their rows move in the last bits
(1e-6 after a few steps on the tiny checkpoints, a level of a pixel now and then).

`rows_apart` runs the modules a family names (`ROW_WISE_MODULES` beside its loop: Wan's condition embedder and patch
embedding, Qwen-Image's timestep embedder and modulation layers) once per row while a batched pass runs, so each
row's is computed as it is alone; those modules are a small share of a pass's work. Every other module runs
batched. The rows of a batched pass then equal their runs alone exactly (the step-scheduling and batching feature
mixins assert `torch.equal`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from typing import Any

import torch


def _split(value: Any, rows: int, row: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value[row : row + 1]
    return value


def _join(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, tuple | list):
        return type(first)(_join([output[index] for output in outputs]) for index in range(len(first)))
    return first  # None, or a value every row shares


def _row_by_row(forward: Any, rows: int) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        outputs = [
            forward(
                *(_split(arg, rows, row) for arg in args),
                **{name: _split(value, rows, row) for name, value in kwargs.items()},
            )
            for row in range(rows)
        ]
        return _join(outputs)

    return run


@contextlib.contextmanager
def rows_apart(model: torch.nn.Module, patterns: tuple[str, ...], rows: int) -> Iterator[None]:
    """While the block runs, the submodules of `model` whose names match `patterns` (fnmatch: "blocks.*.mod") run
    once per row of a pass over `rows` rows, their tensor arguments of `rows` rows cut into rows and their outputs
    joined again. Nothing changes for one row."""
    if rows <= 1 or not patterns:
        yield
        return
    patched = [
        module
        for name, module in model.named_modules()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    ]
    for module in patched:
        module.forward = _row_by_row(module.forward, rows)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again
