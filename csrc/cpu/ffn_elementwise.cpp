// The FFN's activation and gate as one elementwise pass over (rows, F), for the route whose
// GEMMs are torch's (fastformer/ops/ffn.py: cpu.onednn, bf16 on CPUs with AVX512-BF16 / AMX
// dot products, and fp32 calls of a few rows). With g the pre-activation (the GEMM output with
// its bias) and, gated, u the up projection (formulas: common/activations.h):
//   forward:   h = act(g) * m            gated: h = act(g) * u * m
//   backward:  d g = dh * m * act'(g)    gated: d g = dh * m * u * act'(g), d u = dh * m * act(g)
//              and h again when the caller needs it (d W_down = dy^T h): the forward saves g
//              (and u) only, never h.
// m is dropout's keep / (1 - p) (1 without dropout): the packed kernel's mask (ffn.cpp),
// keep(r, c) = Philox(seed, offset + r * cols + c) >= threshold, drawn per run of kMaskRun
// elements of a row (philox_vec.h) into a row of factors the vector loop multiplies by.
// Per element: read g (u, dh), write h (d g, d u) once, the math in fp32 (fp64 for fp64) and
// one rounding per output. Eager PyTorch's SwiGLU backward makes three passes over saved
// act(g), u and dh plus the autograd sums; recomputing act(g) here costs a few vector
// instructions per element, against a memory pass saved.
// With a limit L (gated only): g' = min(g, L) and u' = clamp(u, -L, L) replace g and u above, and
// the clamps pass the gradient where the bounds hold (g <= L, -L <= u <= L), as torch.clamp's.
// With up_shift c (gated only): u' + c stands for u in h and d g (gpt-oss's (up + 1) * glu).
// With identity set, the pass is dropout alone, h = g * m (ops/dropout.py runs it on x forward
// and on dy backward).
// One task per block of rows (at::parallel_for); rows are contiguous (column stride 1), any row
// stride (g and u are the two halves of one (rows, 2F) buffer).
#include <ATen/Parallel.h>

#include <algorithm>

#include "common/activations.h"
#include "common/philox.h"
#include "cpu/act_vec.h"
#include "cpu/cpu_kernels.h"
#include "cpu/philox_vec.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kElementsPerTask = 32768;  // parallel grain: enough work to pay a wake-up
constexpr int64_t kMaskRun = 256;            // dropout factors drawn at a time (a multiple of kV)

// factors[0, run) = keep / (1 - p) of row r's elements [c, c + run) (0 where dropped), then 0 up
// to the next multiple of kV (a tail's unused lanes).
template <typename A, int64_t kV>
inline void mask_factors(const FfnActArgs& a, int64_t r, int64_t c, int64_t run, uint32_t threshold,
                         A scale, uint32_t* words, A* factors) {
  philox_words(a.offset + static_cast<uint64_t>(r * a.cols + c), a.seed, run, words);
  std::fill(factors, factors + run, scale);
  zero_dropped(words, run, threshold, factors);
  std::fill(factors + run, factors + (run + kV - 1) / kV * kV, A(0));
}

template <typename T, Activation Act>
void ffn_act_typed(const FfnActArgs& a) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  using M = ActMath<V>;
  constexpr int64_t kV = V::size();
  const int64_t n = a.cols;
  const bool gated = a.up != nullptr, backward = a.dh != nullptr, dropout = a.dropout_p > 0;
  const bool identity = a.identity;  // dropout alone: h = g * m (forward only; ops/dropout.py)
  const uint32_t threshold = dropout ? dropout_threshold(a.dropout_p) : 0;
  const A scale = dropout ? static_cast<A>(1.0 / (1.0 - a.dropout_p)) : A(1);
  const bool limited = gated && a.limit > 0;
  const V hi(static_cast<A>(a.limit)), lo(static_cast<A>(-a.limit));
  const bool shifted = gated && a.up_shift != 0.0;
  const V shift(static_cast<A>(a.up_shift));
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(n, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    uint32_t words[kMaskRun];
    alignas(64) A factors[kMaskRun];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = static_cast<const T*>(a.gate) + r * a.ld_gate;
      const T* u = gated ? static_cast<const T*>(a.up) + r * a.ld_up : nullptr;
      const T* dh = backward ? static_cast<const T*>(a.dh) + r * a.ld_dh : nullptr;
      T* h = a.h ? static_cast<T*>(a.h) + r * a.ld_h : nullptr;
      T* dg = backward ? static_cast<T*>(a.d_gate) + r * a.ld_d_gate : nullptr;
      T* du = backward && gated ? static_cast<T*>(a.d_up) + r * a.ld_d_up : nullptr;
      for (int64_t c = 0; c < n; c += kV) {
        const int64_t w = std::min(kV, n - c);
        if (dropout && c % kMaskRun == 0) {
          mask_factors<A, kV>(a, r, c, std::min(kMaskRun, n - c), threshold, scale, words, factors);
        }
        const V mv = dropout ? V::loadu(factors + c % kMaskRun) : V(A(1));
        V gv = w == kV ? load_acc(g + c) : load_acc(g + c, w);
        V uv = gated ? (w == kV ? load_acc(u + c) : load_acc(u + c, w)) : V(A(1));
        V g_pass(A(1)), u_pass(A(1));  // the clamps' gradients: 1 where the bounds hold, else 0
        if (limited) {
          if (backward) {
            g_pass = gv.le(hi);
            u_pass = uv.ge(lo) * uv.le(hi);
          }
          gv = at::vec::minimum(gv, hi);
          uv = at::vec::clamp(uv, lo, hi);
        }
        if (shifted) uv = uv + shift;
        if (!backward) {
          V hv = identity ? gv : activation<Act, V, M>(gv);
          if (gated) hv = hv * uv;
          if (dropout) hv = hv * mv;
          store_acc(h + c, hv, w);
          continue;
        }
        const ValueGrad<V> act = activation_value_grad<Act, V, M>(gv);
        V dhv = w == kV ? load_acc(dh + c) : load_acc(dh + c, w);
        if (dropout) dhv = dhv * mv;
        if (gated) {
          store_acc(du + c, limited ? dhv * act.value * u_pass : dhv * act.value, w);
          store_acc(dg + c, limited ? dhv * uv * act.grad * g_pass : dhv * uv * act.grad, w);
          if (h) store_acc(h + c, dropout ? act.value * uv * mv : act.value * uv, w);
        } else {
          store_acc(dg + c, dhv * act.grad, w);
          if (h) store_acc(h + c, dropout ? act.value * mv : act.value, w);
        }
      }
    }
  });
}

}  // namespace

void ffn_act(const FfnActArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) {
    dispatch_activation(static_cast<Activation>(args.activation), [&](auto act) {
      ffn_act_typed<decltype(tag), decltype(act)::value>(args);
    });
  });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
