#!/bin/bash
# Where serving spends the CPU: a CB server and a gateway in front of it, benchmarks/serving.py
# through the gateway, CPU seconds of both processes (and of the server's event-loop thread)
# per 1,000 streamed tokens from /proc, and py-spy raw profiles of both for
# benchmarks/spy_breakdown.py. Run from the root of the checkout to measure:
#   benchmarks/serving_cpu.sh LABEL LOOP HTTP RATE [NUM_REQUESTS] [OUT_ROOT]
#   e.g. benchmarks/serving_cpu.sh after_r2 uvloop httptools 2 32 /tmp/serving_cpu
# Ports 18001 (server) and 18000 (gateway); the gateway config is written to OUT_ROOT.
set -u
LABEL=$1; LOOP=$2; HTTP=$3; RATE=$4; NUM_REQUESTS=${5:-32}; OUT_ROOT=${6:-/tmp/serving_cpu}
# Modules of the checkout in the working directory (the one served and measured).
RUNNER=(-m benchmarks.run_app_with_loop)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=$OUT_ROOT/$LABEL; mkdir -p "$OUT"
PY=.venv/bin/python
$PY - "$OUT_ROOT/gateway.json" <<'PYEOF'
import json, sys
config = json.load(open("configs/client_config.json"))
config.update(continuous_batching_server_urls=["http://127.0.0.1:18001"],
              static_batching_server_urls=[], openai_jumper_configs=[])
json.dump(config, open(sys.argv[1], "w"), indent=1)
PYEOF
$PY "${RUNNER[@]}" cb configs/cb_server_config.json 18001 "$LOOP" "$HTTP" > "$OUT/cb.log" 2>&1 &
CB=$!
$PY "${RUNNER[@]}" gateway "$OUT_ROOT/gateway.json" 18000 "$LOOP" "$HTTP" > "$OUT/gw.log" 2>&1 &
GW=$!
trap 'kill $GW $CB 2>/dev/null' EXIT
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:18001/health >/dev/null && curl -sf http://127.0.0.1:18000/health >/dev/null && break
  sleep 1  # start-up only: waiting for the model to load
done
BENCH=(-m benchmarks.serving --base-url http://127.0.0.1:18000/v1 --ignore-eos)
"$PY" "${BENCH[@]}" --rate inf --num-requests 4 --max-tokens 16 > "$OUT/warmup.txt" 2>&1
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
g0=$(cpu $GW); c0=$(cpu $CB); m0=$(cpu $CB/task/$CB); t0=$(date +%s.%N)
.venv/bin/py-spy record -r 200 -f raw -o "$OUT/gw.raw" --pid $GW -d 900 --nonblocking > "$OUT/spy_gw.log" 2>&1 &
SPY_GW=$!
.venv/bin/py-spy record -r 200 -f raw -o "$OUT/cb.raw" --pid $CB -d 900 --nonblocking --threads > "$OUT/spy_cb.log" 2>&1 &
SPY_CB=$!
"$PY" "${BENCH[@]}" --rate "$RATE" --num-requests "$NUM_REQUESTS" --max-tokens 64 \
    --label "$LABEL" --json "$OUT/serving.json" > "$OUT/serving.txt" 2>&1
g1=$(cpu $GW); c1=$(cpu $CB); m1=$(cpu $CB/task/$CB); t1=$(date +%s.%N)
kill -INT $SPY_GW $SPY_CB; wait $SPY_GW $SPY_CB 2>/dev/null
$PY - "$OUT" "$LABEL" "$(getconf CLK_TCK)" "$g0" "$g1" "$c0" "$c1" "$m0" "$m1" "$t0" "$t1" <<'PYEOF'
import json, sys
out, label, hz, *ticks = sys.argv[1:]
g0, g1, c0, c1, m0, m1 = (int(float(t)) for t in ticks[:6])
t0, t1 = (float(t) for t in ticks[6:])
hz = int(hz)
result = json.load(open(f"{out}/serving.json"))
num_tokens = result["total_output_tokens"]
figures = {
    "label": label, "num_tokens": num_tokens, "wall_s": round(t1 - t0, 1),
    "gateway_cpu_s_per_1k_tokens": round((g1 - g0) / hz / num_tokens * 1000, 3),
    "server_cpu_s_per_1k_tokens": round((c1 - c0) / hz / num_tokens * 1000, 3),
    "server_loop_thread_cpu_s_per_1k_tokens": round((m1 - m0) / hz / num_tokens * 1000, 3),
    "completed": result["completed"], "failed": result["failed"],
    "ttft_p50_ms": result["ttft_ms"]["p50"], "tpot_p50_ms": result["tpot_ms"]["p50"],
    "load_average_at_start": result["load_average_at_start"],
}
json.dump(figures, open(f"{out}/cpu.json", "w"), indent=1)
print(json.dumps(figures))
PYEOF
