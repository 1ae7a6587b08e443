// y = x W^T (+ b) for a few rows of x (decoding: one token per sequence), W (O, I) in the
// weights' dtype, x given in fp32 (the binding converts its few rows), y in fp32.
//
// The cost is reading W once: O x I elements streamed from memory (a Llama layer's weights are
// far beyond the caches), against rows x I x O FMAs on values already in registers. torch's
// matmul for one row (MKL / oneDNN GEMV) read weights at 14-20 GB/s on a 2-core Zen 5 where a
// plain sequential read runs at ~30 (benchmarks/decode.py's generate case is these calls).
// Here: tasks over blocks of W's rows (at::parallel_for, each thread streams its own
// contiguous block); within a task WB = max(1, 8 / rows) weight rows are walked together so that
// 8 independent FMA chains hide the FMA latency, each x row read from L1.
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kWeightBytesPerTask = 256 * 1024;  // parallel grain, in bytes of W

// Output rows [o, o + NW): NW weight rows against the R rows of x, NW x R accumulators.
template <typename T, int R, int NW>
inline void weight_rows(const LinearRowsArgs& a, int64_t o) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  const int64_t I = a.in_features, O = a.out_features, full = I / kV * kV;
  const T* W = static_cast<const T*>(a.weight) + o * a.ld_weight;
  V acc[NW][R];
  for (int w = 0; w < NW; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = V(0.0f);
  for (int64_t i = 0; i < full; i += kV) {
    V xv[R];
    for (int r = 0; r < R; ++r) xv[r] = V::loadu(a.x + r * I + i);
    for (int w = 0; w < NW; ++w) {
      const V wv = load_acc(W + w * a.ld_weight + i);
      for (int r = 0; r < R; ++r) acc[w][r] = at::vec::fmadd(wv, xv[r], acc[w][r]);
    }
  }
  for (int w = 0; w < NW; ++w) {
    const T* wrow = W + w * a.ld_weight;
    for (int r = 0; r < R; ++r) {
      float s = reduce_add(acc[w][r]);
      for (int64_t i = full; i < I; ++i) s += static_cast<float>(wrow[i]) * a.x[r * I + i];
      const float b = a.bias ? static_cast<float>(static_cast<const T*>(a.bias)[o + w]) : 0.0f;
      a.y[r * O + o + w] = s + b;
    }
  }
}

template <typename T, int R>
void linear_rows_typed(const LinearRowsArgs& a) {
  constexpr int WB = R >= 8 ? 1 : 8 / R;  // weight rows per step
  const int64_t I = a.in_features, O = a.out_features;
  const int64_t grain = std::max<int64_t>(
      WB, kWeightBytesPerTask / std::max<int64_t>(1, I * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, O, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + WB <= end; o += WB) weight_rows<T, R, WB>(a, o);
    for (; o < end; ++o) weight_rows<T, R, 1>(a, o);
  });
}

template <typename T>
void linear_rows_dispatch(const LinearRowsArgs& a) {
  switch (a.rows) {
    case 1: return linear_rows_typed<T, 1>(a);
    case 2: return linear_rows_typed<T, 2>(a);
    case 3: return linear_rows_typed<T, 3>(a);
    case 4: return linear_rows_typed<T, 4>(a);
    case 5: return linear_rows_typed<T, 5>(a);
    case 6: return linear_rows_typed<T, 6>(a);
    case 7: return linear_rows_typed<T, 7>(a);
    default: return linear_rows_typed<T, 8>(a);
  }
}

}  // namespace

void linear_rows(const LinearRowsArgs& args) {
  switch (args.dtype) {
    case DType::f32: return linear_rows_dispatch<float>(args);
    case DType::bf16: return linear_rows_dispatch<c10::BFloat16>(args);
    case DType::f16: return linear_rows_dispatch<c10::Half>(args);
    default: return;  // the binding takes f32 / bf16 / f16 weights only
  }
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
