#!/usr/bin/env bash
# Prefill + decode vLLM with KVStreamConnector, kvstream proxy in front, one request, the
# transfer's trace. Usage: MODEL=/path/to/model bash examples/vllm/one_host.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv-vllm/bin/python}
BIN=$(dirname "$PY")
MODEL=${MODEL:?set MODEL to a model directory or hub id}
NATS=nats://127.0.0.1:4222
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_CPU_OMP_THREADS_BIND=nobind \
       OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
rm -f /tmp/kvstream-prefill-spans.jsonl /tmp/kvstream-decode-spans.jsonl
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT

"$BIN/kvstream" nats --port 4222 & pids+=($!)
engine() {  # role port kv_role extra-json
    "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$2" --block-size 32 \
        --enforce-eager --max-model-len 512 --kv-transfer-config "{\"kv_connector\":\"KVStreamConnector\",
        \"kv_connector_module_path\":\"kvstream.adapters.vllm\",\"kv_role\":\"$3\"$4,
        \"kv_connector_extra_config\":{\"nats_url\":\"$NATS\",\"endpoint\":\"http://127.0.0.1:$2\",
        \"trace_file\":\"/tmp/kvstream-$1-spans.jsonl\"}}" > "/tmp/kvstream-$1.log" 2>&1 &
    pids+=($!)
}
engine prefill 8100 kv_producer ""
engine decode 8200 kv_consumer ",\"kv_load_failure_policy\":\"recompute\""
"$BIN/kvstream" proxy --port 8000 --nats-url "$NATS" & pids+=($!)

for port in 8100 8200; do
    until curl -sf "localhost:$port/health" >/dev/null; do sleep 1; done
done
sleep 2  # both announcements reach the proxy
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model":"'"$MODEL"'","prompt":"w5 w6 w7 w8 w9 w10 w11 w12","max_tokens":16,"temperature":0}'
echo
sleep 6  # span batches are written every 5 s
"$BIN/kvstream" trace /tmp/kvstream-prefill-spans.jsonl /tmp/kvstream-decode-spans.jsonl
