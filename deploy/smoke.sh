#!/usr/bin/env bash
# GPU smoke test of PPD: hold a 3-turn conversation under one x-dynamo-session-id and check that
# turns 2 and 3 ran decode-local. Two ways:
#
# One node (deploy/smoke.sh [1p3d|2p2d|3p1d]): serve graphs/ppd-trtllm.yaml (the gateway stand-in,
# the PPD endpoint picker, Dynamo's frontend, TensorRT-LLM prefill and decode workers on 4 GPUs;
# GRAPH=graphs/ppd-relay-trtllm.yaml: the relay router instead); pass when turns 2-3 report cached
# prompt tokens (usage.prompt_tokens_details.cached_tokens > 0) and the picker's (or router's)
# ppd_decisions_total{route="decode_local",turn="follow_up"} grew by 2. Everything started is
# stopped on exit (also on failure or Ctrl-C).
#
#   uv sync --extra trtllm          # once: Dynamo's TensorRT-LLM backend in .venv
#   export HF_TOKEN=hf_...          # Llama 3.1 is gated (only needed for the first download)
#   deploy/smoke.sh [1p3d|2p2d|3p1d]
#
# A cluster (deploy/smoke.sh k8s): the chart installed with routing=picker (deploy/README.md);
# the conversation goes through the Gateway, and the workers' and picker's own metrics (read in
# their pods with kubectl exec) must show turn 1 through a prefill worker and turns 2-3 on the
# decode worker that served turn 1 with no prefill worker involved, plus the cached tokens and
# the picker's decode_local decisions above. Run it on an otherwise idle deployment.
#
# Environment (defaults in brackets):
#   one node: MODEL [meta-llama/Llama-3.1-8B-Instruct]   MODEL_DIR [~/models/llama-3.1-8b-instruct]
#     SKIP_PREPARE [0]: 1 = MODEL_DIR is ready (deploy/prepare_model.py was run)
#     GRAPH [graphs/ppd-trtllm.yaml]   REPLICAS [from the preset; set it empty for none]
#     HTTP_PORT [8000] NATS_PORT [4222] ETCD_PORT [2379]   READY_TIMEOUT [2400 s]
#     PYTHON [.venv/bin/python]   RUN_DIR [runs/smoke-PRESET-TIMESTAMP]
#   k8s: NAMESPACE [llm]  RELEASE [ppd]  GATEWAY [inference-gateway]  GATEWAY_NAMESPACE [NAMESPACE]
#     GATEWAY_URL [http://<the Gateway's address>:GATEWAY_PORT]  GATEWAY_PORT [80]
#     SYSTEM_PORT [9090: the workers' Dynamo system port]  PICKER_METRICS_PORT [28808]
#     KUBECTL [kubectl]  PYTHON [python3]
#   both: MAX_TOKENS [48]
# Exit code: 0 pass, 1 fail (the reason and where the logs are on stderr), 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET="${1:-1p3d}"
case "$PRESET" in
    1p3d) preset_replicas="" ;;
    2p2d) preset_replicas="prefill-gpu1=1,decode-gpu1=0" ;;
    3p1d) preset_replicas="prefill-gpu1=1,prefill-gpu2=1,decode-gpu1=0,decode-gpu2=0" ;;
    k8s) preset_replicas="" ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "usage: $0 [1p3d|2p2d|3p1d|k8s]" >&2; exit 2 ;;
esac
REPLICAS="${REPLICAS-$preset_replicas}"
GRAPH="${GRAPH:-graphs/ppd-trtllm.yaml}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
MODEL_DIR="${MODEL_DIR:-$HOME/models/llama-3.1-8b-instruct}"
SKIP_PREPARE="${SKIP_PREPARE:-0}"
if [ "$PRESET" = k8s ]; then PYTHON="${PYTHON:-python3}"; else PYTHON="${PYTHON:-.venv/bin/python}"; fi
HTTP_PORT="${HTTP_PORT:-8000}"
NATS_PORT="${NATS_PORT:-4222}"
ETCD_PORT="${ETCD_PORT:-2379}"
READY_TIMEOUT="${READY_TIMEOUT:-2400}"
MAX_TOKENS="${MAX_TOKENS:-48}"
RUN_DIR="${RUN_DIR:-runs/smoke-$PRESET-$(date +%Y%m%d-%H%M%S)}"
NAMESPACE="${NAMESPACE:-llm}"
RELEASE="${RELEASE:-ppd}"
GATEWAY="${GATEWAY:-inference-gateway}"
GATEWAY_NAMESPACE="${GATEWAY_NAMESPACE:-$NAMESPACE}"
GATEWAY_PORT="${GATEWAY_PORT:-80}"
SYSTEM_PORT="${SYSTEM_PORT:-9090}"
PICKER_METRICS_PORT="${PICKER_METRICS_PORT:-28808}"
KUBECTL="${KUBECTL:-kubectl}"
OUT="$RUN_DIR.out"
SESSION="smoke-$$-$RANDOM"

log() { printf '[smoke] %s\n' "$*"; }
fail() { printf '[smoke] FAIL: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || [ -x "$PYTHON" ] \
    || fail "$PYTHON not found: run \`uv sync --extra trtllm\` first (or set PYTHON)"
command -v curl >/dev/null || fail "curl is required"
if [ "$PRESET" = k8s ]; then
    command -v "$KUBECTL" >/dev/null || fail "$KUBECTL not found (set KUBECTL)"
fi

if [ "$PRESET" != k8s ] && [ "$SKIP_PREPARE" != 1 ]; then
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

if [ "$PRESET" = k8s ]; then
    if [ -z "${GATEWAY_URL:-}" ]; then
        address="$("$KUBECTL" -n "$GATEWAY_NAMESPACE" get gateway "$GATEWAY" \
            -o jsonpath='{.status.addresses[0].value}')" \
            || fail "kubectl could not read Gateway $GATEWAY_NAMESPACE/$GATEWAY (set GATEWAY, GATEWAY_NAMESPACE or GATEWAY_URL)"
        [ -n "$address" ] || fail "Gateway $GATEWAY_NAMESPACE/$GATEWAY has no address yet (kubectl get gateway: PROGRAMMED?)"
        GATEWAY_URL="http://$address:$GATEWAY_PORT"
    fi
    BASE="${GATEWAY_URL%/}"
    MODEL_NAME="$(curl -sf "$BASE/v1/models" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
        || fail "$BASE/v1/models did not answer through the Gateway"
    log "gateway $BASE/v1 (model $MODEL_NAME); release $RELEASE in namespace $NAMESPACE"
else
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

fi

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
elif cmd == "decisions":  # decisions METRICS_TEXT ROUTE TURN -> turns routed so (ppd_decisions_total)
    total = 0.0
    for line in open(path):
        if line.startswith("ppd_decisions_total{") and f'route="{sys.argv[3]}"' in line \
                and f'turn="{sys.argv[4]}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    print(int(total))
elif cmd == "requests":  # requests METRICS_TEXT -> requests a worker's generate endpoint served
    total = 0.0
    for line in open(path):
        if line.startswith("dynamo_component_requests_total{") and 'dynamo_endpoint="generate"' in line:
            total += float(line.rsplit(" ", 1)[1])
    print(int(total))
elif cmd == "turn":  # turn BEFORE AFTER TURN DECODE_POD|- -> the decode pod that served the turn
    def load(file):
        return {(role, pod): int(n) for role, pod, n in (line.split() for line in open(file) if line.strip())}
    before, after = load(path), load(sys.argv[3])
    turn, home = int(sys.argv[4]), sys.argv[5]
    delta = {key: n - before.get(key, 0) for key, n in after.items()}
    prefill = sum(n for (role, _), n in delta.items() if role == "prefill")
    served = {pod: n for (role, pod), n in delta.items() if role == "decode" and n}
    if turn == 1 and prefill != 1:
        sys.exit(f"turn 1: the prefill workers served {prefill} requests, not 1 (it should go through one)")
    if turn > 1 and prefill != 0:
        sys.exit(f"turn {turn}: a prefill worker served it ({prefill} request(s)): not decode-local")
    if list(served.values()) != [1]:
        sys.exit(f"turn {turn}: decode workers served {served or 'nothing'}, not one request on one worker")
    (pod,) = served
    if home != "-" and pod != home:
        sys.exit(f"turn {turn}: served by {pod}, not by {home}, the decode worker holding the conversation")
    print(pod)
PY

decode_local_count() {
    curl -sf "$METRICS_URL" >"$TMP/metrics.txt" || fail "router metrics $METRICS_URL did not answer"
    "$PYTHON" "$TMP/chat.py" decisions "$TMP/metrics.txt" decode_local follow_up
}

# k8s: the release's pods of one role (the chart's labels), and a pod's /metrics read inside it.
pods() {
    "$KUBECTL" -n "$NAMESPACE" get pods --field-selector=status.phase=Running -o name \
        -l "app.kubernetes.io/name=dynamo-ppd-$1,app.kubernetes.io/instance=$RELEASE"
}
scrape() {
    "$KUBECTL" -n "$NAMESPACE" exec "$1" -c main -- python3 -c \
        'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
        "http://127.0.0.1:$2/metrics"
}
snapshot() {  # FILE <- "role pod requests" for every prefill and decode pod
    : >"$1"
    local role pod
    for role in prefill decode; do
        for pod in $(pods "$role"); do
            scrape "$pod" "$SYSTEM_PORT" >"$TMP/pod-metrics.txt" \
                || fail "could not read $pod's metrics on port $SYSTEM_PORT (SYSTEM_PORT)"
            echo "$role $pod $("$PYTHON" "$TMP/chat.py" requests "$TMP/pod-metrics.txt")" >>"$1"
        done
    done
    grep -q '^prefill ' "$1" && grep -q '^decode ' "$1" \
        || fail "no running prefill and decode pods of release $RELEASE in namespace $NAMESPACE"
}
picker_decisions() {  # ROUTE TURN -> decisions summed over the picker pods
    local total=0 pod n
    for pod in $(pods picker); do
        scrape "$pod" "$PICKER_METRICS_PORT" >"$TMP/pod-metrics.txt" \
            || fail "could not read $pod's metrics on port $PICKER_METRICS_PORT (PICKER_METRICS_PORT)"
        n="$("$PYTHON" "$TMP/chat.py" decisions "$TMP/pod-metrics.txt" "$1" "$2")"
        total=$((total + n))
    done
    echo "$total"
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

if [ "$PRESET" = k8s ]; then
    [ -n "$(pods picker)" ] || fail "no running picker pods of release $RELEASE (installed with routing=picker?)"
    snapshot "$TMP/snapshot0"
    before="$(picker_decisions decode_local follow_up)"
    first_before="$(picker_decisions via_prefill first)"
else
    before="$(decode_local_count)"
fi
home="-"
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
    if [ "$PRESET" = k8s ]; then  # which workers served it, from their own request counters
        snapshot "$TMP/snapshot$turn"
        home="$("$PYTHON" "$TMP/chat.py" turn "$TMP/snapshot$((turn - 1))" "$TMP/snapshot$turn" "$turn" "$home")" \
            || fail "turn $turn did not run where the picker should have sent it (workers' metrics above)"
        log "turn $turn: decode worker $home$([ "$turn" = 1 ] && echo ", after a prefill worker" || echo ", no prefill worker")"
    fi
    sleep 1  # KV events reach the router, the session record reaches etcd
done
if [ "$PRESET" = k8s ]; then
    after="$(picker_decisions decode_local follow_up)"
    first_after="$(picker_decisions via_prefill first)"
    [ $((first_after - first_before)) -ge 1 ] \
        || fail "the picker recorded no first turn via prefill (ppd_decisions_total{route=\"via_prefill\",turn=\"first\"})"
else
    after="$(decode_local_count)"
    grep '^ppd_decisions_total{' "$TMP/metrics.txt" | sed 's/^/[smoke]   /' || true
fi
if [ $((after - before)) -lt 2 ]; then
    fail "the router sent $((after - before)) of 2 follow-up turns decode-local (ppd_decisions_total)"
fi
log "PASS: turns 2-3 ran decode-local with cached tokens (decode_local follow-ups $before -> $after)"
