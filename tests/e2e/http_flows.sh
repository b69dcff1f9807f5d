#!/usr/bin/env bash
# The HTTP gateway's flows with curl, as a shell user runs them: submit a video (JSON), follow its progress as
# server-sent events, fetch its state and its MP4, list it, delete it; submit one as a multipart form; see a
# refused field answered 400 in OpenAI's error shape. Usage: http_flows.sh BASE_URL (e.g. http://127.0.0.1:8000).
set -euo pipefail
base="${1:?usage: http_flows.sh BASE_URL}"
frames="${NUM_FRAMES:-5}"
py="${PY:-python3}"  # with PyAV and Pillow, for checking the answers
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
field() { "$py" -c "import json, sys; print(json.load(sys.stdin)$1)"; }

# A video job from a JSON body.
created="$(curl -sS --fail-with-body -H "Content-Type: application/json" \
    -d "{\"prompt\": \"a red circle\", \"size\": \"64x64\", \"num_frames\": $frames, \"fps\": 8, \"num_inference_steps\": 2}" \
    "$base/v1/videos")"
id="$(echo "$created" | field "['id']")"
echo "created $id"

# Its progress as server-sent events, until the job completes (the stream ends then).
curl -sS -N --fail-with-body --max-time 240 "$base/v1/videos/$id/events" | tee "$work/events"
grep -q "^event: completed" "$work/events"

# Its state, its content (an MP4), the list, then deletion.
status="$(curl -sS --fail-with-body "$base/v1/videos/$id" | field "['status']")"
[ "$status" = completed ] || { echo "status $status" >&2; exit 1; }
curl -sS --fail-with-body -o "$work/video.mp4" -D "$work/headers" "$base/v1/videos/$id/content"
grep -qi "^content-type: video/mp4" "$work/headers"
"$py" - "$work/video.mp4" "$frames" <<'PY'
import sys, av
with av.open(sys.argv[1]) as container:
    count = sum(1 for _ in container.decode(video=0))
assert count == int(sys.argv[2]), count
PY
curl -sS --fail-with-body "$base/v1/videos?limit=100" | field "['data']" | grep -q "$id"
curl -sS --fail-with-body -X DELETE "$base/v1/videos/$id" | field "['deleted']" | grep -q True
code="$(curl -sS -o /dev/null -w '%{http_code}' "$base/v1/videos/$id")"
[ "$code" = 404 ] || { echo "a deleted video answered $code" >&2; exit 1; }

# A multipart form, as OpenAI's clients send it; the same job as JSON would make.
multipart="$(curl -sS --fail-with-body -F prompt="a blue square" -F size=64x64 -F num_frames="$frames" \
    -F num_inference_steps=2 "$base/v1/videos")"
echo "$multipart" | field "['status']" | grep -Eq "queued|in_progress"
curl -sS --fail-with-body -X DELETE "$base/v1/videos/$(echo "$multipart" | field "['id']")" >/dev/null

# An uploaded input_reference goes to the model; a text-to-video model refuses images, naming the field.
"$py" -c "from PIL import Image; Image.new('RGB', (64, 64), 'red').save('$work/first.png')"
code="$(curl -sS -o "$work/refused" -w '%{http_code}' -F prompt="a red square" -F size=64x64 \
    -F input_reference=@"$work/first.png" "$base/v1/videos")"
[ "$code" = 400 ] || { echo "an image for a text-to-video model answered $code" >&2; cat "$work/refused" >&2; exit 1; }
field "['error']['param']" <"$work/refused" | grep -q "^images"

# A bad field: 400 naming it, in OpenAI's error shape.
code="$(curl -sS -o "$work/error" -w '%{http_code}' -H "Content-Type: application/json" \
    -d '{"prompt": "x", "size": "big"}' "$base/v1/videos")"
[ "$code" = 400 ] && [ "$(field "['error']['param']" <"$work/error")" = size ]
echo "curl flows: ok"
