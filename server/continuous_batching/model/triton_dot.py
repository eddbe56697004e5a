"""The one matrix product of the engine's Triton kernels, in either precision they run in.

Imported only by the kernel modules (themselves imported on first use), so that Triton still
decides at their decoration time whether they are compiled or interpreted.
"""

import triton
import triton.language as tl


@triton.jit
def dot_f32(a, b, like, NATIVE_DOT: tl.constexpr):
    """``a @ b`` accumulated in float32.

    NATIVE_DOT: both operands rounded to ``like``'s 16-bit dtype (a no-op for the one already
    in it) and multiplied on tensor cores with float32 accumulation, as flash attention and
    GPTQ kernels do. Else both in float32 with IEEE dots: exact, for float32 models and for
    the interpreter, whose 16-bit ``tl.dot`` is wrong.
    """
    if NATIVE_DOT:
        out = tl.dot(a.to(like.dtype), b.to(like.dtype), out_dtype=tl.float32)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out
