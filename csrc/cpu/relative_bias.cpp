// DeBERTa's disentangled relative-position bias on CPU: a gather forward, a scatter-add backward
// (semantics: fastformer/reference/relative_bias.py; the op: fastformer/ops/relative_bias.py).
//
// c2p (B, H, Lq, W) and p2c (B, H, Lk, W), contiguous, either may be absent: the attention's
// content rows against its 2S relative-position embeddings (W = 2S). Index tables ci, pi
// (Lq, Lk) int64 in [0, W); visible (Bv, Lq, Lk) bool with Bv in {1, B}, or absent (all visible).
//   forward   out[b,h,i,j]    = visible[b,i,j] ? c2p[b,h,i,ci[i,j]] + p2c[b,h,j,pi[i,j]] : -inf
//   backward  dc2p[b,h,i,c]   = sum over visible j with ci[i,j] = c of dout[b,h,i,j]
//             dp2c[b,h,j,c]   = sum over visible i with pi[i,j] = c of dout[b,h,i,j]
// Sums in fp32 (fp64 for fp64), each output rounded once.
//
// torch.gather on these shapes ran ~28 ms per (4, 12, 512, 512) bf16 gather on 2 Zen 5 cores
// (it copies the expanded index); a row here reads its c2p row (W values, L1) and one p2c value
// per key from the (b, h) slab of p2c (Lk * W values: 0.5-1 MB at Lk = W = 512, in L2), and
// writes Lk values once. Measured at that shape, bf16, both terms and a mask: forward 12-14 ms,
// backward 4.5 ms (dc2p) + 10 ms (dp2c); fp32 26-29 ms, 17 + 25 ms. That is ~6-10 cycles per
// element, well above what the bytes moved cost (~2 ms); blocking the forward's rows over key
// tiles and narrowing the index tables to int16 were tried and changed nothing measurable.
//
// Parallel: the forward and dc2p over (b, h, i) rows (a row writes only its own output / dc2p
// row); dp2c over (b, h, strip of kStrip keys): the task reads its strip of every dout row and
// accumulates into kStrip rows of dp2c held in fp32 in the task (kStrip * (W + 16) * 4 bytes:
// 132 KB at W = 512), so no two tasks write the same dp2c row.
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kElementsPerTask = 32768;
constexpr int64_t kStrip = 64;
constexpr int64_t kLine = 64;  // bytes per cache line

template <typename T>
void relative_bias_fwd_typed(const RelativeBiasArgs& a) {
  using A = acc_t<T>;
  const int64_t rows = a.B * a.H * a.Lq, Lq = a.Lq, Lk = a.Lk, W = a.W;
  const T* c2p = static_cast<const T*>(a.c2p);
  const T* p2c = static_cast<const T*>(a.p2c);
  T* out = static_cast<T*>(a.out);
  const T masked = static_cast<T>(-std::numeric_limits<A>::infinity());
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(Lk, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % Lq, bh = r / Lq, b = bh / a.H;
      const int64_t* ci = a.c2p_index + i * Lk;
      const int64_t* pi = a.p2c_index + i * Lk;
      const bool* vis = a.visible ? a.visible + ((a.Bv == 1 ? 0 : b) * Lq + i) * Lk : nullptr;
      const T* c_row = c2p ? c2p + r * W : nullptr;
      const T* p_slab = p2c ? p2c + bh * Lk * W : nullptr;
      T* o = out + r * Lk;
      // The row reads c_row backwards (the relative position falls as j rises), which the
      // hardware prefetcher does not follow: fetch the next row's W values ahead ((4, 12, 512,
      // 512) bf16, both terms, 2 Zen 5 cores: 19 ms without, 12 ms with).
      if (c_row) {
        for (int64_t k = 0; k < W; k += kLine / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(c_row + W + k);
      }
      for (int64_t j = 0; j < Lk; ++j) {
        if (vis && !vis[j]) {
          o[j] = masked;
          continue;
        }
        A v = 0;
        if (c_row) v += static_cast<A>(c_row[ci[j]]);
        if (p_slab) v += static_cast<A>(p_slab[j * W + pi[j]]);
        o[j] = static_cast<T>(v);
      }
    }
  });
}

template <typename T>
void relative_bias_dc2p(const RelativeBiasArgs& a) {
  using A = acc_t<T>;
  const int64_t rows = a.B * a.H * a.Lq, Lq = a.Lq, Lk = a.Lk, W = a.W;
  const T* dout = static_cast<const T*>(a.dout);
  T* dc2p = static_cast<T*>(a.dc2p);
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(Lk, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(W);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % Lq, b = r / Lq / a.H;
      const int64_t* ci = a.c2p_index + i * Lk;
      const bool* vis = a.visible ? a.visible + ((a.Bv == 1 ? 0 : b) * Lq + i) * Lk : nullptr;
      const T* g = dout + r * Lk;
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < Lk; ++j) {
        if (!vis || vis[j]) acc[ci[j]] += static_cast<A>(g[j]);
      }
      T* d = dc2p + r * W;
      for (int64_t c = 0; c < W; ++c) d[c] = static_cast<T>(acc[c]);
    }
  });
}

template <typename T>
void relative_bias_dp2c(const RelativeBiasArgs& a) {
  using A = acc_t<T>;
  const int64_t Lq = a.Lq, Lk = a.Lk, W = a.W;
  const int64_t strips = (Lk + kStrip - 1) / kStrip, tasks = a.B * a.H * strips;
  const T* dout = static_cast<const T*>(a.dout);
  T* dp2c = static_cast<T*>(a.dp2c);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Rows padded by one line: at W = 512 fp32 rows 2 KB apart fall into 2 of L1's 64 sets, and
    // the 64 rows a query row touches evicted each other (dp2c (4, 12, 512, 512) bf16: 15 ms).
    const int64_t stride = W + kLine / static_cast<int64_t>(sizeof(A));
    std::vector<A> acc(kStrip * stride);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / strips, j0 = (t % strips) * kStrip, b = bh / a.H;
      const int64_t n = std::min(kStrip, Lk - j0);
      std::fill(acc.begin(), acc.begin() + n * stride, A(0));
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t* pi = a.p2c_index + i * Lk + j0;
        const bool* vis = a.visible ? a.visible + ((a.Bv == 1 ? 0 : b) * Lq + i) * Lk + j0 : nullptr;
        const T* g = dout + (bh * Lq + i) * Lk + j0;
        for (int64_t jj = 0; jj < n; ++jj) {
          if (!vis || vis[jj]) acc[jj * stride + pi[jj]] += static_cast<A>(g[jj]);
        }
      }
      T* d = dp2c + (bh * Lk + j0) * W;
      for (int64_t jj = 0; jj < n; ++jj) {
        for (int64_t c = 0; c < W; ++c) d[jj * W + c] = static_cast<T>(acc[jj * stride + c]);
      }
    }
  });
}

}  // namespace

void relative_bias_fwd(const RelativeBiasArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { relative_bias_fwd_typed<decltype(tag)>(args); });
}

void relative_bias_bwd(const RelativeBiasArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (args.dc2p) relative_bias_dc2p<T>(args);
    if (args.dp2c) relative_bias_dp2c<T>(args);
  });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
