"""Small @triton.jit helpers shared by the kernels (written once, used everywhere)."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x (fp32) cast to DTYPE with round-to-nearest-even.

    GPUs round when converting fp32 -> bf16; Triton 3.9's interpreter truncates instead, which
    doubles the output error of every bf16 kernel it tests. Under the interpreter only, round
    the fp32 bits to bf16 precision first (RNE; NaN and inf are preserved), so the tests see
    the rounding the GPU does.
    """
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def dot_operand(x, INTERPRET: tl.constexpr):
    """A tl.dot operand. Triton 3.9's interpreter computes tl.dot on bfloat16 wrongly
    (triton-lang/triton#11584): under the interpreter only, bf16 tiles are upcast to fp32
    (exact; the products then sum in fp32 as on tensor cores). GPUs keep bf16 tensor-core dots."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return x.to(tl.float32)
    return x


@triton.jit
def tanh(x):
    """fp32 tanh from exp2 (libdevice's does not run under the interpreter): an odd Taylor
    polynomial to x^9 below |x| = 1/4 (truncation < 1e-8 relative), else (1 - e) / (1 + e)
    with e = exp(-2 |x|) (no overflow at any |x|); within 1.5 fp32 ulps under the interpreter
    (tests: at most 4)."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    x2 = x * x
    poly = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
                                                                 + x2 * (62.0 / 2835.0)))))
    r = tl.where(a < 0.25, poly, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -r, r)


@triton.jit
def dropout_word(seed, element):
    """The dropout word of int64 element numbers (csrc/common/philox.h, reference/rng.py): word
    element % 4 of Philox4x32-10 at counter element // 4 (tl.randint4x's four words)."""
    w0, w1, w2, w3 = tl.randint4x(seed, element >> 2)
    which = element & 3
    return tl.where(which < 2, tl.where(which == 0, w0, w1), tl.where(which == 2, w2, w3))
