#!/usr/bin/env bash
# The standing order's GPU run in one device-tool call (under 9 minutes of command time):
# the Triton kernels against their torch references, the engine against transformers at the
# 1B shape, decode attention alone (and its tuning sweep), int4 against bf16, then the 8B
# shape. Each step has its own time limit, so one that hangs or crashes costs only itself.
#
# Device tool call (wheels from `pip download` into .whl, as the device README shows):
#   carry: .whl, models/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,
#          config.json,generation_config.json,chat_template.jinja}
#   command: bash benchmarks/gpu_standing_order.sh
# Results land in $OUT (JSON + plots + one log); the log's "== step rc=" lines say what ran.
set -u
OUT=${OUT:-/tmp/gpu_standing_order}
mkdir -p "$OUT"
LOG="$OUT/standing_order.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

# HBM bandwidth for the floors: the vendor figures (H200 4.8 TB/s, H100 SXM 3.35 TB/s).
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GBS=3350
case "$GPU_NAME" in *H200*) GBS=4800 ;; esac
echo "gpu: $GPU_NAME, floors at $GBS GB/s; torch $(python3 -c 'import torch; print(torch.__version__)')" | tee "$LOG"

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log its output and its status
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

step kernels 100 python3 -m pytest -q -x -p no:cacheprovider \
  tests/engine/test_triton_paged_attention.py tests/engine/test_triton_fused.py \
  tests/engine/test_triton_int4.py tests/engine/test_cb_cuda_graphs.py -k "not engine_decodes"
step gpu_1b 140 python3 -m benchmarks.gpu --shapes 1b --bandwidth-gbs "$GBS" --out "$OUT/gpu_1b.json"
step decode_attention 40 python3 -m benchmarks.bench_decode_attention --bandwidth-gbs "$GBS" \
  --out "$OUT/decode_attention.json"
step decode_attention_sweep 50 python3 -m benchmarks.bench_decode_attention --sweep \
  --contexts 200 2000 --iters 20 --bandwidth-gbs "$GBS"
step int4 40 python3 -m benchmarks.bench_int4_gpu --shapes 8b --out "$OUT/int4_gpu.json"
step gpu_8b 200 python3 -m benchmarks.gpu --shapes 8b --bandwidth-gbs "$GBS" --out "$OUT/gpu_8b.json"
echo "== done in ${SECONDS}s" | tee -a "$LOG"
