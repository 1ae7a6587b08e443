// Vector activation math for common/activations.h (the scalar specializations live there): the
// ActMath specialization for at::vec::Vectorized, shared by the fused FFN (ffn.cpp) and the
// elementwise FFN pass (ffn_elementwise.cpp). exp, erf and tanh are vec_math.h's inline ones
// (fp32 at the AVX2 / AVX-512 levels; at::vec's Sleef calls elsewhere).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "common/activations.h"
#include "cpu/vec_math.h"

namespace fastformer {
template <typename A>
struct ActMath<at::vec::Vectorized<A>> {
  using V = at::vec::Vectorized<A>;
  static V exp(const V& x) { return cpu::CPU_CAPABILITY::fast_exp(x); }
  static V erf(const V& x) { return cpu::CPU_CAPABILITY::fast_erf(x); }
  static V erf_gauss(const V& z, V& gauss) { return cpu::CPU_CAPABILITY::fast_erf(z, &gauss); }
  static V tanh(const V& x) { return cpu::CPU_CAPABILITY::fast_tanh(x); }
  static V relu(const V& x) { return V::blendv(x, V(A(0)), x < V(A(0))); }  // NaN stays NaN
  static V step(const V& x) { return (x > V(A(0))) & V(A(1)); }
};
}  // namespace fastformer
