// Fused CPU kernels of the CB engine's decoder (see __init__.py for how they are built and
// chosen). One translation unit (one compile of torch's headers per ISA level) made of
// headers split by concern:
//
//   common.h       scalar helpers: dtype conversions, float32 loops g++ vectorises
//   simd.h         the vector operations, once per ISA (Simd512, Simd256)
//   attention.h    paged decode attention
//   elementwise.h  RMSNorm, SiLU- and GELU-tanh-and-mul, RoPE + K/V writes, logit refinement
//   gemm.h         the bf16 matmul of the linear layers and its weight packing
//   qgemm.h        the matmul of weights kept quantised (repacked GGUF types)
//   qgemm_i8.h     the same with int8 activations, per weight group
//   qgemm_super.h  int8 activations per super-block, integer sums (K-quants, GPTQ g128)
//   qgemm_panels.h the int8 mode's prefill on AVX512-BF16 (Q8_0, Q4_0, Q4_1): weights as bf16
//   qgemm_vnni.h   super-block layouts' batches and prefills as one AVX512-VNNI integer GEMM
//   lane_tiles.h   the super-block layouts tiled at load: 16 weight rows interleaved
//   dequantize_rows.h  some rows of a quantised weight (plain or tiled) to float32
//   qgemm_lanes.h  their matmul with the weight rows in the lanes (AVX512-VNNI)
//   qgemm_lanes_avx2.h  the same on AVX2, 8 rows a register
//
// Every kernel computes in float32 and rounds once to the output dtype. The build's -m flags
// name its ISA level (cpu_isa.py); the module says which with ``isa`` and ``gemm``.
#include <torch/extension.h>

#include "attention.h"
#include "dequantize_rows.h"
#include "elementwise.h"
#include "gemm.h"
#include "qgemm.h"
#include "qgemm_i8.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL (its tensors stay referenced by the caller): the
  // engine thread spends most of a step in them, and the server's event loop (HTTP, SSE,
  // detokenisation) must not wait for a matmul to end, nor the next kernel for the loop.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // window: keys at positions > context_len - 1 - window only (0: all); softcap: scores ->
  // softcap * tanh(scores / softcap) (0: off).
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "decode attention from the paged KV cache (q [T,H,D] -> [T,H,D])", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of [T,N] rows, output in the weight's dtype");
  m.def("add_rms_norm", &add_rms_norm, nogil,
        "x += delta (float32 x, in place), then RMSNorm of x");
  m.def("silu_and_mul", &silu_and_mul, nogil, "SiLU(gate) * up of [T,2I] -> [T,I]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, nogil, "GELU-tanh(gate) * up of [T,2I] -> [T,I]");
  m.def("rope_write_kv", &rope_write_kv, nogil,
        "rotate q/k of fused qkv, write k/v to cache slots");
  m.def("refine_logits", &refine_logits, nogil,
        "float32 logits of a 16-bit lm_head output, each row's top k recomputed exactly");
  m.def("quant_linear", &quant_linear_any, nogil,
        "x [M,K] (bf16/fp32) . W^T (+ bias) with W kept quantised (qgemm.h) -> [M,N] x.dtype; "
        "is_int8_activations: x quantised per group to int8 (qgemm_i8.h)",
        py::arg("x"), py::arg("codes"), py::arg("bits"), py::arg("group"),
        py::arg("group_scale"), py::arg("group_offset") = py::none(),
        py::arg("super_scale") = py::none(), py::arg("super_offset") = py::none(),
        py::arg("bias") = py::none(), py::arg("is_scalar") = false,
        py::arg("is_int8_activations") = false, py::arg("is_tiled") = false);
  m.def("dequantize_rows", &dequantize_rows, nogil,
        "rows [R] (int64) of a quantised weight (plain, or tiled: lane_tiles.h) -> float32 "
        "[R, K], the values of the torch reference (an embedding lookup)",
        py::arg("codes"), py::arg("bits"), py::arg("group"), py::arg("group_scale"),
        py::arg("group_offset"), py::arg("super_scale"), py::arg("super_offset"),
        py::arg("rows"), py::arg("is_tiled"), py::arg("code_offset"));
#if defined(LLM_SUITE_HAS_QGEMM_LANES)
  m.def("lane_tile_codes", &lane_tile_codes, nogil,
        "packed codes [N, K*bits/8] -> the tiled layout of qgemm_lanes.h (N a multiple of 16; "
        "8-bit codes + code_offset as tile_bits-bit tiles: 6, or 5 for codes of 0..31)",
        py::arg("codes"), py::arg("bits"), py::arg("code_offset") = 0, py::arg("tile_bits") = 6);
  m.attr("has_lane_tiles") = true;
#else
  m.attr("has_lane_tiles") = false;
#endif
#if defined(LLM_SUITE_HAS_QUANT_PANELS)
  m.attr("has_quant_panels") = true;
  m.attr("quant_panel_min_rows") = kPanelMinRows;
#else
  m.attr("has_quant_panels") = false;
#endif
#if defined(LLM_SUITE_HAS_QGEMM_VNNI)
  m.attr("vnni_min_rows") = kVnniMinRows;          // groups of 32 (Q4_K, Q5_K, GPTQ g128)
  m.attr("vnni_min_rows_g16") = kVnniMinRowsG16;  // groups of 16 (Q6_K)
#else
  m.attr("vnni_min_rows") = -1;  // no VNNI GEMM in this build
  m.attr("vnni_min_rows_g16") = -1;
#endif
#if defined(LLM_SUITE_HAS_QGEMM_I8)
  m.attr("has_int8_activations") = true;
#else
  m.attr("has_int8_activations") = false;
#endif
#if defined(LLM_SUITE_HAS_SIMD)
  m.attr("vector_width") = Simd::W;
  m.attr("gemm") = kGemmKind;
  m.def("pack_bf16_weight", &pack_bf16_weight, nogil,
        "W [N,K] bf16 -> the layout bf16_linear reads");
  m.def("bf16_linear", &bf16_linear, nogil,
        "x [M,K] bf16 . W^T (+ bias) from a packed W -> [M,N] bf16",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
#endif
}
