"""Peak resident DiT parameter bytes and step time without offload, with module-wise and with layerwise offload.

The DiT has two experts, as Wan2.2 A14B (`transformer` for the high-noise steps,
`transformer_2` after the boundary): here two copies of the preset's transformer, the first
for the first half of the steps. A step is one CFG pair of forwards. "Resident" is what the
offload machinery has onloaded (`ResidencyCounter`), so on a CPU-only machine, where the
device is the CPU and every copy is a no-op, the bytes are what a GPU would hold and the
step time is the machinery's own overhead, not transfer time. Without offload, both experts
are resident. Prints JSON.

    python bench/offload.py [--preset small] [--steps 4] [--size 128 128 9] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from dit_svc.offload import (
    ModuleOffloader,
    ResidencyCounter,
    apply_offload,
    group_offload_units,
    parameter_bytes,
)
from families.wan.components import build_transformer
from families.wan.presets import DEFAULT_REQUESTS


def load_experts(path: Path, device: torch.device) -> list[torch.nn.Module]:
    return [WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.float32).to(device).eval() for _ in "12"]


def run_config(path: Path, mode: str | None, blocks: int, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    experts = load_experts(path, device)
    total_bytes = sum(parameter_bytes([*e.parameters(), *e.buffers()]) for e in experts)
    counter = None
    if mode == "module":
        offloader = ModuleOffloader(device)
        for expert in experts:
            apply_offload(expert, "module", device, offloader=offloader)
        counter = ResidencyCounter(list(offloader.units.values()), experts, device)
    elif mode == "layerwise":
        units = []
        for expert in experts:
            apply_offload(expert, "layerwise", device, blocks_per_group=blocks)
            units += group_offload_units(expert)
        counter = ResidencyCounter(units, [b for e in experts for b in e.blocks], device)

    height, width, frames = args.size
    config = experts[0].config
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8, generator=generator)
    embeds = [torch.randn(1, 64, config.text_dim, generator=generator).to(device) for _ in range(2)]
    latents = latents.to(device)

    def step(expert: torch.nn.Module, t: int) -> None:
        timestep = torch.tensor([t], device=device)
        for embed in embeds:  # conditional and unconditional
            expert(hidden_states=latents, timestep=timestep, encoder_hidden_states=embed, return_dict=False)

    num_blocks = len(experts[0].blocks)
    seconds = []
    with torch.no_grad():
        step(experts[0], 999)  # warm-up
        for i in range(args.steps):
            expert = experts[0] if i < args.steps // 2 else experts[1]
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(expert, 999 - i * 1000 // args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)

    result = {
        "mode": mode or "none",
        "blocks_per_group": blocks if mode == "layerwise" else None,
        "step_s_mean": round(statistics.mean(seconds), 4),
        "step_s": [round(s, 4) for s in seconds],
    }
    if counter is None:
        result.update(peak_resident_bytes=total_bytes, max_resident_blocks=sum(len(e.blocks) for e in experts))
    else:
        assert counter.violations == [], counter.violations[:3]
        # In module mode the counted "blocks" are the experts.
        resident_blocks = counter.max_resident_blocks * (num_blocks if mode == "module" else 1)
        result.update(
            peak_resident_bytes=counter.max_resident_bytes,
            max_resident_blocks=resident_blocks,
            onloads=counter.onloads,
            offloads=counter.offloads,
        )
    result["resident_ratio_vs_none"] = round(result["peak_resident_bytes"] / total_bytes, 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(DEFAULT_REQUESTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, nargs=3, default=[128, 128, 9], metavar=("H", "W", "FRAMES"))
    parser.add_argument("--blocks", default="1,2,4", help="--offload-blocks values to measure")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "transformer"
        torch.manual_seed(0)
        model = build_transformer(args.preset)
        model.save_pretrained(path)
        configs = [(None, 1), ("module", 1)] + [("layerwise", int(n)) for n in args.blocks.split(",")]
        results = [run_config(path, mode, blocks, args) for mode, blocks in configs]
        num_blocks = len(model.blocks)

    print(
        json.dumps(
            {
                "benchmark": "dit_cpu_offload",
                "preset": args.preset,
                "experts": 2,
                "blocks_per_expert": num_blocks,
                "size": args.size,
                "steps": args.steps,
                "dtype": "fp32",
                "device": args.device,
                "results": results,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
