#!/usr/bin/env bash
# On one CUDA GPU in bf16: first Wan2.1-T2V-1.3B at real size against diffusers' WanPipeline (bench/wan_gpu.py:
# seconds per step, step caches, regional compilation, the cluster end to end, peak memory), FLUX.1-dev at real
# size against FluxPipeline, eager and compiled (bench/flux_gpu.py: 1024x1024, 28 steps), HunyuanVideo 1.5 at 480p
# against HunyuanVideo15Pipeline stage by stage (bench/hunyuanvideo_gpu.py: 480x848, 33 frames, 8 steps), then the
# DiT's throughput levers, each benchmark as on CPU (bench/step_cache.py, bench/compile.py, bench/batching.py,
# bench/lora.py); written together to ${OUT:-.}/bench-gpu.json, one key per benchmark. Each makes its own
# random-weight checkpoint (the step cache's quality part uses the committed demo model), so a GPU machine
# needs nothing but `make bench-gpu`. BENCH_GPU_QUICK=1 runs the short variants (bench/wan_gpu.py --quick fits
# 10 minutes on an H100, checkpoint included, and bench/hunyuanvideo_gpu.py is sized to fit the same, by estimate;
# the others take a few minutes in all).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out_dir=${OUT:-.}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "${BENCH_GPU_QUICK:-0}" = "1" ]; then
    wan_size=--quick steps=20 cases=8 presets=tiny,small rounds=1
else
    wan_size= steps=50 cases=24 presets=tiny,small rounds=3
fi

run() {  # name, then the command; a benchmark that fails is recorded as such and the others still run
    local name=$1
    shift
    echo "bench-gpu: $name" >&2
    if "$@" > "$work/$name.json" 2> "$work/$name.log"; then
        :
    else
        tail -n 20 "$work/$name.log" >&2
        printf '{"failed": true, "log_tail": %s}\n' "$(tail -n 20 "$work/$name.log" | "$python" -c 'import json,sys; print(json.dumps(sys.stdin.read()))')" > "$work/$name.json"
    fi
}

run wan_gpu "$python" bench/wan_gpu.py ${wan_size:+"$wan_size"}
run flux_gpu "$python" bench/flux_gpu.py --model "$work/flux.1-dev"
run flux_gpu_compiled "$python" bench/flux_gpu.py --model "$work/flux.1-dev" --compile
rm -rf "$work/flux.1-dev"
run hunyuanvideo_gpu "$python" bench/hunyuanvideo_gpu.py --model "$work/hunyuanvideo-1.5-480p"
rm -rf "$work/hunyuanvideo-1.5-480p"
run step_cache "$python" bench/step_cache.py --device cuda --dtype bf16 --preset small --steps "$steps" --cases "$cases"
run compile "$python" bench/compile.py --device cuda --dtype bf16 --preset small --steps 10 --requests 3
run batching "$python" bench/batching.py -f deploy/docker-compose.single-gpu.yml --presets "$presets" --rounds "$rounds"
run lora "$python" bench/lora.py --device cuda --dtype bf16 --preset small --steps 10 --rounds "$rounds"

"$python" - "$work" "$out_dir/bench-gpu.json" <<'PY'
import json, sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
report = {name: json.loads((work / f"{name}.json").read_text()) for name in ("wan_gpu", "flux_gpu", "flux_gpu_compiled", "hunyuanvideo_gpu", "step_cache", "compile", "batching", "lora")}
out.write_text(json.dumps(report, indent=2) + "\n")
print(out)
PY
