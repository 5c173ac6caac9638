#!/usr/bin/env bash
# GPU smoke test of PPD on a real node: serve graphs/ppd-trtllm.yaml (the gateway, the PPD endpoint
# picker, Dynamo's frontend, TensorRT-LLM prefill and decode workers on 4 GPUs; GRAPH=
# graphs/ppd-relay-trtllm.yaml: the relay router instead), hold a 3-turn conversation under one
# x-dynamo-session-id, and check that turns 2 and 3 ran decode-local: the decode worker reported
# cached prompt tokens (usage.prompt_tokens_details.cached_tokens > 0) and the picker's (or the
# router's) ppd_decisions_total{route="decode_local",turn="follow_up"} grew by 2. Everything started is
# stopped on exit (also on failure or Ctrl-C).
#
#   uv sync --extra trtllm          # once: Dynamo's TensorRT-LLM backend in .venv
#   export HF_TOKEN=hf_...          # Llama 3.1 is gated (only needed for the first download)
#   deploy/smoke.sh [1p3d|2p2d|3p1d]
#
# Environment (defaults in brackets):
#   MODEL [meta-llama/Llama-3.1-8B-Instruct]   MODEL_DIR [~/models/llama-3.1-8b-instruct]
#   SKIP_PREPARE [0]: 1 = MODEL_DIR is ready (deploy/prepare_model.py was run)
#   GRAPH [graphs/ppd-trtllm.yaml]   REPLICAS [from the preset; set it empty for none]
#   HTTP_PORT [8000] NATS_PORT [4222] ETCD_PORT [2379]   READY_TIMEOUT [2400 s]
#   PYTHON [.venv/bin/python]   RUN_DIR [runs/smoke-PRESET-TIMESTAMP]   MAX_TOKENS [48]
# Exit code: 0 pass, 1 fail (the reason and where the logs are on stderr), 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET="${1:-1p3d}"
case "$PRESET" in
    1p3d) preset_replicas="" ;;
    2p2d) preset_replicas="prefill-gpu1=1,decode-gpu1=0" ;;
    3p1d) preset_replicas="prefill-gpu1=1,prefill-gpu2=1,decode-gpu1=0,decode-gpu2=0" ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "usage: $0 [1p3d|2p2d|3p1d]" >&2; exit 2 ;;
esac
REPLICAS="${REPLICAS-$preset_replicas}"
GRAPH="${GRAPH:-graphs/ppd-trtllm.yaml}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
MODEL_DIR="${MODEL_DIR:-$HOME/models/llama-3.1-8b-instruct}"
SKIP_PREPARE="${SKIP_PREPARE:-0}"
PYTHON="${PYTHON:-.venv/bin/python}"
HTTP_PORT="${HTTP_PORT:-8000}"
NATS_PORT="${NATS_PORT:-4222}"
ETCD_PORT="${ETCD_PORT:-2379}"
READY_TIMEOUT="${READY_TIMEOUT:-2400}"
MAX_TOKENS="${MAX_TOKENS:-48}"
RUN_DIR="${RUN_DIR:-runs/smoke-$PRESET-$(date +%Y%m%d-%H%M%S)}"
OUT="$RUN_DIR.out"
SESSION="smoke-$$-$RANDOM"

log() { printf '[smoke] %s\n' "$*"; }
fail() { printf '[smoke] FAIL: %s\n' "$*" >&2; exit 1; }

[ -x "$PYTHON" ] || fail "$PYTHON not found: run \`uv sync --extra trtllm\` first (or set PYTHON)"
command -v curl >/dev/null || fail "curl is required"

if [ "$SKIP_PREPARE" != 1 ]; then
    log "model directory $MODEL_DIR (deploy/prepare_model.py)"
    "$PYTHON" deploy/prepare_model.py --model "$MODEL" --out "$MODEL_DIR" \
        || fail "could not prepare $MODEL_DIR (HF_TOKEN set? disk space?)"
fi

TMP="$(mktemp -d)"
SERVE_PID=""
cleanup() {
    local code=$?
    if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
        log "stopping dynamo-ppd serve (pid $SERVE_PID)"
        kill -TERM "$SERVE_PID" 2>/dev/null || true
        for _ in $(seq 1 240); do
            kill -0 "$SERVE_PID" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$SERVE_PID" 2>/dev/null; then
            log "serve still running after 120 s: SIGKILL (workers may be left; see $RUN_DIR/run.json)"
            kill -KILL "$SERVE_PID" 2>/dev/null || true
        fi
    fi
    [ -z "$SERVE_PID" ] || wait "$SERVE_PID" 2>/dev/null || true
    rm -rf "$TMP"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$(dirname "$RUN_DIR")"
serve_args=(serve "$GRAPH" --model-dir "$MODEL_DIR" --run-dir "$RUN_DIR" --http-port "$HTTP_PORT"
            --nats-port "$NATS_PORT" --etcd-port "$ETCD_PORT" --ready-timeout 600)
[ -z "$REPLICAS" ] || serve_args+=(--replicas "$REPLICAS")
log "dynamo-ppd ${serve_args[*]}  (output: $OUT)"
: >"$OUT"  # exists before the wait loop reads it (the background job opens it when it starts)
"$PYTHON" -m dynamo_ppd "${serve_args[@]}" >"$OUT" 2>&1 &
SERVE_PID=$!

# Ready once `serve` prints the router's metrics URL (after the model is listed on /v1/models).
deadline=$((SECONDS + READY_TIMEOUT))
METRICS_URL=""
while [ -z "$METRICS_URL" ]; do
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then
        tail -n 30 "$OUT" >&2 || true
        fail "dynamo-ppd serve exited before it was ready; see $OUT and $RUN_DIR/logs/"
    fi
    [ "$SECONDS" -lt "$deadline" ] || fail "not ready after ${READY_TIMEOUT} s; see $OUT and $RUN_DIR/logs/"
    METRICS_URL="$(sed -En 's/^(router|picker) metrics: (http[^ ]*).*$/\2/p' "$OUT" | head -n 1)"
    [ -n "$METRICS_URL" ] || sleep 2
done
BASE="http://127.0.0.1:$HTTP_PORT"
MODEL_NAME="$(curl -sf "$BASE/v1/models" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
    || fail "$BASE/v1/models did not answer"
log "ready: $BASE/v1 (model $MODEL_NAME), routing metrics $METRICS_URL"

# Requests are built and streamed responses parsed by this helper (no jq needed).
cat >"$TMP/chat.py" <<'PY'
import json, sys
cmd, path = sys.argv[1], sys.argv[2]
if cmd == "body":  # body MESSAGES MODEL MAX_TOKENS
    print(json.dumps({"model": sys.argv[3], "messages": json.load(open(path)), "stream": True,
                      "max_tokens": int(sys.argv[4]), "stream_options": {"include_usage": True}}))
elif cmd == "parse":  # parse SSE_FILE MESSAGES NEXT_USER_MESSAGE -> "prompt_tokens cached_tokens"
    text, usage = "", None
    for line in open(path):
        line = line.strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            sys.exit(f"error in the response: {chunk['error']}")
        for choice in chunk.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
        usage = chunk.get("usage") or usage
    if not usage or not text:
        sys.exit(f"no {'usage' if text else 'text'} in the response")
    messages = json.load(open(sys.argv[3]))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": sys.argv[4]}]
    json.dump(messages, open(sys.argv[3], "w"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    print(usage["prompt_tokens"], cached)
elif cmd == "decode_local":  # decode_local METRICS_TEXT -> follow-up turns routed decode-local
    total = 0.0
    for line in open(path):
        if line.startswith("ppd_decisions_total{") and 'route="decode_local"' in line \
                and 'turn="follow_up"' in line:
            total += float(line.rsplit(" ", 1)[1])
    print(int(total))
PY

decode_local_count() {
    curl -sf "$METRICS_URL" >"$TMP/metrics.txt" || fail "router metrics $METRICS_URL did not answer"
    "$PYTHON" "$TMP/chat.py" decode_local "$TMP/metrics.txt"
}

"$PYTHON" - "$TMP/messages.json" <<'PY'
import json, sys
question = ("I am planning a two-week trip along the Norwegian coast in late September. I care about "
            "fjords, small fishing villages, hiking that a reasonably fit person can do in a day, and "
            "local food. I will travel by ferry and train, not by car. Suggest an itinerary, day by "
            "day, and say for each stop why it is worth it, how to get there from the previous one, "
            "and what the weather is usually like at that time of the year. Keep it practical.")
json.dump([{"role": "user", "content": question}], open(sys.argv[1], "w"))
PY

before="$(decode_local_count)"
follow_ups=("Which of those days would you drop if I only had ten days?"
            "Thanks. What should I pack for that trip?"
            "")
for turn in 1 2 3; do
    "$PYTHON" "$TMP/chat.py" body "$TMP/messages.json" "$MODEL_NAME" "$MAX_TOKENS" >"$TMP/body.json"
    curl -sSN --fail-with-body --max-time 300 "$BASE/v1/chat/completions" \
        -H 'Content-Type: application/json' -H "x-dynamo-session-id: $SESSION" \
        --data-binary "@$TMP/body.json" >"$TMP/turn$turn.sse" \
        || fail "turn $turn: request failed: $(head -c 500 "$TMP/turn$turn.sse")"
    read -r prompt_tokens cached_tokens < <("$PYTHON" "$TMP/chat.py" parse "$TMP/turn$turn.sse" \
        "$TMP/messages.json" "${follow_ups[$((turn - 1))]}") || fail "turn $turn: bad response"
    log "turn $turn: prompt_tokens=$prompt_tokens cached_tokens=$cached_tokens"
    if [ "$turn" -ge 2 ] && [ "$cached_tokens" -le 0 ]; then
        fail "turn $turn reported no cached tokens: the decode worker did not reuse the history"
    fi
    sleep 1  # KV events reach the router, the session record reaches etcd
done
after="$(decode_local_count)"
grep '^ppd_decisions_total{' "$TMP/metrics.txt" | sed 's/^/[smoke]   /' || true
if [ $((after - before)) -lt 2 ]; then
    fail "the router sent $((after - before)) of 2 follow-up turns decode-local (ppd_decisions_total above)"
fi
log "PASS: turns 2-3 ran decode-local with cached tokens (decode_local follow-ups $before -> $after)"
