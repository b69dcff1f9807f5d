"""Regional compilation of the DiT (`--compile`): torch.compile each repeated transformer block.

A DiT is a stack of identical blocks (the classes the model lists in diffusers' `_repeated_blocks`), so one
block's code is compiled and reused for every block, as diffusers' `compile_repeated_blocks` and vLLM-Omni's
`regionally_compile` do. Each block is compiled with `nn.Module.compile`, so the compiled region is the
block's whole call: its forward and the hooks the parallel plan, quantization and offload put on it.

Rules:
- Every rank compiles its own blocks after those were applied (dit_svc/denoise.py `make_denoiser`):
  compiling first would trace blocks that the parallel plan then changes.
- Compilation is lazy: the first request pays it, later ones reuse it. The backend is inductor on every
  device (Triton on CUDA, C++ with OpenMP on CPU).
- A request of a new size must not recompile: `configure_dynamo` sets dynamo's process-wide options for
  that (a DiT stage process compiles nothing else), and `RECOMPILE_LIMIT` bounds the structural variants
  that remain; past it dynamo runs a variant eagerly, slower but never wrong.
- The ring's point-to-point passes, HSDP's FSDP2 hooks and diffusers' group-offload hooks stay eager;
  Ulysses' all-to-alls, the padding mask's all-gather and tensor parallelism's DTensors are compiled.
"""

from __future__ import annotations

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
    import torch._dynamo
    import torch.fx.experimental._config

    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    # Under Ulysses and Ring the attention processor reads the request's token count through the block
    # (`SequenceParallelState.seq_len`): a symbol like the sizes, not a constant that recompiles.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # Sizes equal at the first trace get symbols of their own, not one symbol guarded on their equality.
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
