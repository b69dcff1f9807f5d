"""Regional compilation of the DiT (`--compile`): torch.compile each repeated transformer block.

A DiT is a stack of identical blocks (the classes the model lists in diffusers' `_repeated_blocks`:
WanTransformerBlock, QwenImageTransformerBlock). Compiling one block's code and reusing it for every block
costs a fraction of compiling the whole model and gives most of its speed, which is why diffusers
(`ModelMixin.compile_repeated_blocks`) and vLLM-Omni (`regionally_compile`) compile this way. Each block is
compiled with `nn.Module.compile`, as both do, so the compiled region is the block's whole call: its forward
and the hooks that the parallel plan, quantization and offload put on it. Every rank of a DiT group compiles
its own blocks, after those were applied (dit_svc/denoise.py `make_denoiser`): compiling first would trace
blocks that the parallel plan then changes.

`module.compile` is lazy: a block compiles on its first call, so the first request pays the compile time
(`bench/compile.py` measures it) and later ones reuse it. The backend is inductor on every device: Triton
kernels on CUDA, C++ (g++) with OpenMP on CPU, so the same flag runs on both.

Recompilation stays bounded. dynamo caches one compiled graph per variant of a block's code and recompiles
when a guard of every cached one fails; a request of a new size must not be such a variant:

- `dynamic=True` traces every size as a symbol from the first call, so a new height, width, frame count
  or text length reuses the compiled graph instead of compiling another (dynamo's default would compile
  the first size static and recompile the first time a size changes).
- `allow_unspec_int_on_nn_module`: dynamo would take an int attribute reached through a module as a
  constant. Under Ulysses and Ring the block's attention processor reads the request's token count
  (`SequenceParallelState.seq_len`, through `block.attn1.processor`), so every token count would compile
  again; with this setting it is a symbol like the sizes.
- `use_duck_shape = False`: dynamo gives two sizes that are equal at the first trace one symbol, and then
  guards on their being equal. Qwen-Image's text rotary table is a view whose offset equalled the image
  token count at 64x64 and not at 48x80, which cost four more graphs on one rank; without duck sizing the
  second size compiles nothing.
- What is left are variants of structure, not size: a text mask present or absent (Qwen-Image's two
  guidance branches), sequence-parallel padding or none, the first block's inputs being views of the
  split sequence, a step cache's hooks. On the tests' requests dynamo compiled 1 graph for Wan on one rank
  and under HSDP, 5 or 6 under Ulysses 2 (the split hook's region counted), 4 for Qwen-Image on one rank;
  Qwen-Image's block forward under Ulysses 2 needs 8 graphs (mask x padding x first block), as many as
  dynamo's default limit. `RECOMPILE_LIMIT` caps the graphs of one code at 16 for headroom; past it dynamo
  runs that variant eagerly and logs it: slower, never wrong.

The three settings are dynamo's process-wide configuration; a DiT stage process compiles nothing else.

What stays eager around or inside a block: the ring's point-to-point passes (dynamo does not compile P2P
operations, so Ring attention breaks the graph around each hop), HSDP's FSDP2 hooks (the all-gather before
the forward and the reshard after it; torch marks them not to be compiled) and diffusers' group-offload
hooks (marked `torch.compiler.disable`). Everything else is in the compiled graph: Ulysses' all-to-alls and
the padding mask's all-gather (which travels as uint8 for that, dit_svc/parallel/attention.py), and tensor
parallelism's DTensors.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.fx.experimental._config
from torch import nn

# Graphs dynamo keeps per compiled code before it runs a new variant eagerly (its default is 8).
RECOMPILE_LIMIT = 16


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's blocks of the classes its `_repeated_blocks` names, in module order.

    A class matches anywhere in the block's class hierarchy: FSDP2's `fully_shard` (our HSDP) replaces each
    block's class with a subclass named `FSDP<Name>`. This is the one reason not to call diffusers'
    `compile_repeated_blocks`, which matches the class name exactly: under `--use-hsdp` it finds no block
    and raises. Otherwise this does what it does, `module.compile(...)` on each block.
    """
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    if not names:
        raise ValueError(f"{type(transformer).__name__} declares no repeated blocks (_repeated_blocks) to compile")
    blocks = [module for module in transformer.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no module of its repeated block classes {sorted(names)}")
    return blocks


def configure_dynamo() -> None:
    """The process-wide settings that keep recompilation bounded (see the module docstring)."""
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch.fx.experimental._config.use_duck_shape = False


def compile_repeated_blocks(experts: list[nn.Module], *, dynamic: bool | None = True, mode: str | None = None) -> int:
    """Compiles each repeated block of every expert in place, after the parallel plan, quantization and
    offload were applied; returns how many blocks were wrapped. The compile itself happens on first use.

    `dynamic` and `mode` go to torch.compile: dynamic=True keeps one graph across request sizes; mode None
    is inductor's default (`"max-autotune-no-cudagraphs"` searches kernels longer on GPUs).
    """
    configure_dynamo()
    compiled = 0
    for expert in experts:
        for block in repeated_blocks(expert):
            block.compile(dynamic=dynamic, mode=mode)
            compiled += 1
    return compiled
