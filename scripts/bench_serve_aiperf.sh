#!/usr/bin/env bash
# Drive `xllm-vmm serve` with aiperf, a real load generator from PyPI (it installs without torch,
# in a scratch venv), on loopback; the load of `xllm-vmm bench serve` / `vllm bench serve
# --dataset-name random`: ISL 256 (±50 %), OSL 128 with ignore_eos, 128 requests at 32/s.
#
#   bash scripts/bench_serve_aiperf.sh            # the bench Llama (4 layers, hidden 512, bf16)
#   MODEL_DIR=/path/to/hf-dir REQUESTS=32 RATE=8 bash scripts/bench_serve_aiperf.sh
#
# Prints aiperf's summary and the server's mapped KV bytes (peak and after) from /metrics; the
# artifacts stay in $OUT (default /tmp/xllm-vmm-aiperf). Bounded: the server is stopped with
# SIGTERM at the end (or on any failure) and aiperf stops after REQUESTS requests.
set -euo pipefail
VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
OUT=${OUT:-/tmp/xllm-vmm-aiperf}
REQUESTS=${REQUESTS:-128}
RATE=${RATE:-32}
ISL=${ISL:-256}
OSL=${OSL:-128}
if [ ! -x "$VENV/bin/aiperf" ]; then
  python -m venv "$VENV"
  "$VENV/bin/pip" install -q aiperf
fi
MODEL_DIR=${MODEL_DIR:-$(python -c 'from xllm_vmm.bench.engine import bench_model_dir; print(bench_model_dir(4, 512, "bfloat16"))')}
mkdir -p "$OUT"
LOG="$OUT/serve.log"
xllm-vmm serve --model "$MODEL_DIR" --port 0 --model_id=bench \
  --enable_vmm_kvcache=true --vmm_elastic=true --enable_vmm_weights=true --block_size=16 \
  --device-memory=4GiB --max-model-len=$((ISL * 3 / 2 + OSL + 8)) >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 600); do
  URL=$(sed -n 's/.*ready at \(http[^ ]*\).*/\1/p' "$LOG" | head -1)
  [ -n "$URL" ] && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { echo "the server did not start" >&2; cat "$LOG"; exit 1; }
echo "server: $URL"
# aiperf reads the tokenizer from the model directory (it fails with HF_HUB_OFFLINE=1).
env -u HF_HUB_OFFLINE "$VENV/bin/aiperf" profile --model bench --url "$URL" \
  --endpoint-type completions --streaming --tokenizer "$MODEL_DIR" \
  --prompt-input-tokens-mean "$ISL" --random-range-ratio 0.5 --prompt-output-tokens-mean "$OSL" \
  --extra-inputs ignore_eos:true --request-count "$REQUESTS" --request-rate "$RATE" \
  --warmup-request-count 1 --random-seed 0 --output-artifact-dir "$OUT" --no-auto-plot \
  --request-timeout-seconds 600 --use-server-token-count
curl -s "$URL/metrics" | grep -E '^xllm_vmm_(kv_mapped_peak_bytes|tenant_mapped_bytes\{[^}]*tenant="kv")' || true
