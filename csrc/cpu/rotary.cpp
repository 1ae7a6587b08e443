// Rotary position embedding (RoPE) on CPU: forward, and backward as the conjugate rotation.
//
// x (B, H, L, D), any strides with a contiguous last dim; out (B, H, L, D) by its own strides;
// tables cos, sin (L, R/2) contiguous, fp32 (fp64 for fp64 x). For row (b, h, l), i < R/2,
// c = cos[l, i], s = sin[l, i] (negated when conj: the backward dx = R(-theta) dy):
//   rotate-half:  y[i] = x[i] c - x[i + R/2] s,   y[i + R/2] = x[i + R/2] c + x[i] s
//   interleaved:  y[2i] = x[2i] c - x[2i + 1] s,  y[2i + 1] = x[2i + 1] c + x[2i] s
//   y[j] = x[j] for R <= j < D (a byte copy).
// Computed in fp32 (fp64 for fp64) and rounded once to the output type.
//
// One task per block of rows (at::parallel_for over B*H*L rows, ~32K elements per task). Memory
// traffic per element: read x once, write out once; the tables (R/2 * 8 bytes per position) are
// read once per (b, h) and stay in L2 across heads for L * R * 4 bytes <= ~1 MB. Rotate-half
// rows run on SIMD vectors (two half-rows side by side); interleaved rows pair neighbouring
// lanes, done in a scalar loop that the compiler vectorizes (a memory-bound op either way).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kElementsPerTask = 32768;

template <typename T>
void rotate_half_row(const T* x, T* y, const acc_t<T>* c, const acc_t<T>* s, int64_t half,
                     bool conj) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  const V sign(conj ? A(-1) : A(1));
  int64_t i = 0;
  for (; i + kV <= half; i += kV) {
    const V a = load_acc(x + i), b = load_acc(x + half + i);
    const V cv = V::loadu(c + i), sv = V::loadu(s + i) * sign;
    store_acc(y + i, a * cv - b * sv);
    store_acc(y + half + i, b * cv + a * sv);
  }
  if (i < half) {
    const int64_t n = half - i;
    const V a = load_acc(x + i, n), b = load_acc(x + half + i, n);
    const V cv = V::loadu(c + i, n), sv = V::loadu(s + i, n) * sign;
    store_acc(y + i, a * cv - b * sv, n);
    store_acc(y + half + i, b * cv + a * sv, n);
  }
}

template <typename T>
void interleaved_row(const T* x, T* y, const acc_t<T>* c, const acc_t<T>* s, int64_t half,
                     bool conj) {
  using A = acc_t<T>;
  const A sign = conj ? A(-1) : A(1);
  for (int64_t i = 0; i < half; ++i) {
    const A a = to_acc(x[2 * i]), b = to_acc(x[2 * i + 1]);
    const A sv = s[i] * sign;
    y[2 * i] = static_cast<T>(a * c[i] - b * sv);
    y[2 * i + 1] = static_cast<T>(b * c[i] + a * sv);
  }
}

template <typename T>
void rotary_typed(const RotaryArgs& a) {
  using A = acc_t<T>;
  const int64_t half = a.rot_dim / 2;
  const int64_t rows = a.B * a.H * a.L;
  const int64_t pass_bytes = (a.D - a.rot_dim) * static_cast<int64_t>(sizeof(T));
  const A* cos = static_cast<const A*>(a.cos);
  const A* sin = static_cast<const A*>(a.sin);
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(a.D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t l = r % a.L, bh = r / a.L;
      const int64_t h = bh % a.H, b = bh / a.H;
      const T* x = static_cast<const T*>(a.x.ptr) + b * a.x.s[0] + h * a.x.s[1] + l * a.x.s[2];
      T* y = static_cast<T*>(const_cast<void*>(a.out.ptr)) + b * a.out.s[0] + h * a.out.s[1] +
             l * a.out.s[2];
      if (a.interleaved) interleaved_row(x, y, cos + l * half, sin + l * half, half, a.conj);
      else rotate_half_row(x, y, cos + l * half, sin + l * half, half, a.conj);
      if (pass_bytes > 0) std::memcpy(y + a.rot_dim, x + a.rot_dim, pass_bytes);
    }
  });
}

}  // namespace

void rotary(const RotaryArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { rotary_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
