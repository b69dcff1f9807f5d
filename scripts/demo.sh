#!/usr/bin/env bash
# Starts the local cluster on the demo model, generates one short video through it,
# checks that the video shows what the prompt asked for (and writes its frames side
# by side as a PNG), and stops the cluster again, whatever happens in between.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
MODEL="${MODEL:-models/demo}"
PROMPT="${PROMPT:-a red circle moving right on a dark background}"
OUT="${OUT:-out/demo.mp4}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-600}"

log_dir="$(mktemp -d -t stagediff-demo.XXXXXX)"
up_out="$log_dir/up.out"
up_err="$log_dir/up.err"
mkdir -p "$(dirname "$OUT")"

"$PY" -m stagediff.cli up --model "$MODEL" --port 0 --http-port 0 --log-dir "$log_dir" \
    --startup-timeout "$STARTUP_TIMEOUT" >"$up_out" 2>"$up_err" &
up_pid=$!

stop_cluster() {
    local status=$?
    trap - EXIT INT TERM
    if kill -0 "$up_pid" 2>/dev/null; then
        kill -TERM "$up_pid" 2>/dev/null || true
        local up_status=0
        wait "$up_pid" || up_status=$?
        if [ "$up_status" -ne 0 ]; then
            echo "demo: stagediff up exited with code $up_status while stopping" >&2
            [ "$status" -ne 0 ] || status=1
        fi
    fi
    if [ "$status" -ne 0 ]; then
        echo "demo: FAILED (exit $status)" >&2
        echo "--- stagediff up stdout" >&2; cat "$up_out" >&2 || true
        echo "--- stagediff up stderr" >&2; tail -n 50 "$up_err" >&2 || true
        echo "--- service logs are in $log_dir" >&2
    fi
    exit "$status"
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

endpoint=""
deadline=$((SECONDS + STARTUP_TIMEOUT + 30))
while [ -z "$endpoint" ]; do
    endpoint="$(sed -n 's/^ready //p' "$up_out")"
    [ -n "$endpoint" ] && break
    if ! kill -0 "$up_pid" 2>/dev/null; then
        echo "demo: stagediff up exited before the cluster was ready" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "demo: the cluster was not ready within ${STARTUP_TIMEOUT}s" >&2
        exit 1
    fi
    sleep 1
done
echo "demo: cluster ready at $endpoint"

# The model's own defaults (stagediff.json: 64x64, 17 frames, its steps and guidance), then interpolation.
"$PY" -m stagediff.cli generate --endpoint "$endpoint" --prompt "$PROMPT" --seed 7 --interp-exp 1 --out "$OUT"
echo "demo: wrote $OUT"
# The quality check's reading of the video, attribute by attribute (how often the model gets each right:
# BENCHMARKS.md, "The demo model").
if "$PY" -m shapeworld.check "$OUT" --prompt "$PROMPT" --strip "${OUT%.*}_strip.png" --every 4; then
    echo "demo: the video shows what \"$PROMPT\" asks for; its frames are in ${OUT%.*}_strip.png"
else
    echo "demo: the video misses part of \"$PROMPT\" (the reading above); its frames are in ${OUT%.*}_strip.png"
fi
