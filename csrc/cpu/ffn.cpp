// Fused feed-forward block on CPU, forward and backward (semantics: fastformer/reference/ffn.py).
//
//   ffn:    pre = x W1^T + b1   h = act(pre) * keep / (1 - p)   y = h W2^T + b2
//   gated:  g = x Wg^T + bg, u = x Wu^T + bu   h = act(g) * u   y = h Wd^T + bd
// x (N tokens, D), W1/Wg/Wu (F, D), W2/Wd (D, F); keep = Philox(seed, offset + n * F + f) >= p.
//
// Every GEMM is gemm_packed.h's blocked GEMM; the elementwise work lives in its packing (the
// sources and packers of cpu/ffn_operands.h) and epilogue callbacks, so no pass over an (N, F)
// tensor exists on its own:
//   forward, training (the pre-activation is saved; h never exists):
//     GEMM1 (N x F x D): epilogue pre = acc + b1 -> saved (gated: [g | u], one GEMM: the B
//       panels interleave Wg and Wu so a micro-tile holds the gate and up columns of the same
//       NR/2 units, and the epilogue reads both from registers)
//     GEMM2 (N x D x F): A packed as act(pre) * keep (gated: act(g) * u) from saved;
//       epilogue y = acc + b2
//   forward, inference: GEMM1's epilogue computes h = act(acc + b1) * keep (gated:
//     act(g) * u) and stores h only (1 tensor of N x F, not 2); GEMM2 packs h as is.
//   backward (dy given; hd = the dropped-out h, recomputed wherever it is read):
//     dW2 | db2 = dy^T [hd | 1]           B packed as act(pre) * keep from saved, plus a column
//                                         of ones whose output column is db2 (no extra pass)
//     dpre = (dy W2) * keep * act'(pre)   epilogue of the dy W2 GEMM: act' fused, reads pre
//       gated: dg = dh * u * act'(g), du = dh * act(g)   -> d_hidden = [dg | du]
//     dx = dpre W1                        gated: [dg | du] [Wg ; Wu], one GEMM with K = 2F
//     dW1 | db1 = dpre^T [x | 1]          gated: [dg | du]^T [x | 1] -> dWg, dWu, dbg, dbu
// The layers also run alone (FfnArgs::layers): the first as a linear layer x W1^T + b1 with its
// dx / dW1 / db1, the second (act, gate, GEMM2) with its dW2 / db2 / d pre-activation; the gated
// eager autograd route (ops/ffn.py) makes the gate and up projections and the rest three nodes,
// so that autograd frees each saved tensor and gradient when its node returns.
// Memory traffic of the (N, F) tensors: forward writes pre once (gated: g, u) and GEMM2 reads
// it once (per 2048 output columns); backward reads it twice (dW2 packing, dpre epilogue),
// writes dpre once and reads it twice (dx, dW1 packing). Saved for the backward: x, the
// weights and the pre-activation (gated: gate and up), never a post-activation; eager PyTorch
// keeps act(pre) too (GELU: 2 tensors of N x F; SwiGLU: 4).
//
// bf16/fp16 are converted to fp32 while packing and rounded once when stored; fp64 runs the
// same kernels in fp64 (gradcheck). Activation math: common/activations.h, vectorized through
// an ActMath specialization for at::vec::Vectorized.
//
// Why not at::mm (the suggestion): on this machine (2-core Zen 3, AVX2, no AVX-512 or
// AMX) torch's bf16 GEMM has no fast path (1-15 GFLOP/s: bf16 inputs would need fp32 copies
// first), while the packed route converts while packing. In fp32 MKL was ~10% faster until the
// packed micro-kernel prefetched its partial-sum tile and unrolled its k loop (gemm_packed.h);
// since then the packed GEMM measures at or above torch.mm on these shapes (harness, 2 threads,
// (4096 x 768) x (768 x 3072): median 113-132 GFLOP/s vs torch.mm ~97), and since its partial
// sums are stored tile by tile (gemm_packed.h) ~1.1x torch.mm at 2048 x 4096 x 4096, so the fused
// fp32 FFN's margin over eager is mostly the GEMM, then the memory passes it avoids.
// Measured (2 threads, fp32, machine shared with other jobs: interleaved medians):
//   see README.md's FFN table and the ffn suite of fastformer-bench.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/activations.h"
#include "common/philox.h"
#include "cpu/act_vec.h"
#include "cpu/cpu_kernels.h"
#include "cpu/ffn_operands.h"
#include "cpu/gemm_packed.h"
#include "cpu/philox_vec.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

using namespace ffn_operands;  // Blk, the sources and the packers (cpu/ffn_operands.h)

// ---- epilogues -------------------------------------------------------------------------------
// Store v's first `cols` lanes (<= kV) at p.
template <typename T, typename V>
inline void store_lanes(T* p, const V& v, int64_t cols) {
  if (cols >= V::size()) store_acc(p, v);
  else if (cols > 0) store_acc(p, v, cols);
}

// Parameter vector (bias) in the accumulation type, zero padded to a whole number of NR panels.
template <typename T, Scratch kSlot>
acc_t<T>* padded_param(const void* src, int64_t n) {
  using A = acc_t<T>;
  const int64_t padded = round_up_to(n, Blk<A>::kNR) + Blk<A>::kNR;
  A* buf = thread_scratch<A, kSlot>(padded);
  std::fill(buf, buf + padded, A(0));
  if (src != nullptr) {
    const T* s = static_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(s[i]);
  }
  return buf;
}

// out[i][j] = acc + bias[j], then (kActivate) act(.) * keep: GEMM1 (ffn), GEMM2, dx.
template <typename T, bool kActivate>
struct BiasEpilogue {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  T* out;
  int64_t ld;
  const A* bias;  // padded, or null
  Dropout drop;
  Activation act = Activation::relu;  // used iff kActivate
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    if constexpr (kActivate) {
      dispatch_activation(act, [&](auto tag) { rows<decltype(tag)::value>(i0, j0, m, n, tile); });
    } else {
      rows<Activation::relu>(i0, j0, m, n, tile);
    }
  }
  template <Activation Act>
  void rows(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    constexpr int64_t NR = Blk<A>::kNR, kV = V::size();
    alignas(64) A row[NR];
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < NR; c += kV) {
        V v = V::loadu(tile + r * NR + c);
        if (bias != nullptr) v = v + V::loadu(bias + j0 + c);
        if constexpr (kActivate) v = activation<Act>(v);
        v.store(row + c);
      }
      if (kActivate && drop.active()) drop.apply(i0 + r, j0, n, row);
      T* dst = out + (i0 + r) * ld + j0;
      for (int64_t c = 0; c < n; c += kV) store_lanes(dst + c, V::loadu(row + c), n - c);
    }
  }
};

// Gated GEMM1 (interleaved columns): training stores g = acc_g + bg and u = acc_u + bu into
// [g | u] (ld 2F); inference stores h = act(g) * u (ld F).
template <typename T>
struct GatedEpilogue {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  static_assert(Blk<A>::kNR == 2 * V::size(), "one vector of gate and one of up per tile row");
  T* out;
  int64_t hidden;
  const A* b_gate;  // padded
  const A* b_up;
  bool store_preactivation;
  Activation act;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t, const A* tile) const {
    constexpr int64_t kV = V::size();
    const int64_t unit0 = j0 / 2, units = std::min<int64_t>(kV, hidden - unit0);
    if (units <= 0) return;
    const V bg = V::loadu(b_gate + unit0), bu = V::loadu(b_up + unit0);
    if (store_preactivation) {
      for (int64_t r = 0; r < m; ++r) {
        T* dst = out + (i0 + r) * 2 * hidden + unit0;
        store_lanes(dst, V::loadu(tile + r * 2 * kV) + bg, units);
        store_lanes(dst + hidden, V::loadu(tile + r * 2 * kV + kV) + bu, units);
      }
      return;
    }
    dispatch_activation(act, [&](auto tag) {
      for (int64_t r = 0; r < m; ++r) {
        const V g = V::loadu(tile + r * 2 * kV) + bg;
        const V u = V::loadu(tile + r * 2 * kV + kV) + bu;
        store_lanes(out + (i0 + r) * hidden + unit0, activation<decltype(tag)::value>(g) * u, units);
      }
    });
  }
};

// dpre = acc * keep / (1 - p) * act'(pre), pre read from the saved (N, F).
template <typename T>
struct DpreEpilogue {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const T* pre;
  T* dpre;
  int64_t hidden;
  Dropout drop;
  Activation act;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    dispatch_activation(act, [&](auto tag) { rows<decltype(tag)::value>(i0, j0, m, n, tile); });
  }
  template <Activation Act>
  void rows(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    constexpr int64_t NR = Blk<A>::kNR, kV = V::size();
    alignas(64) A row[NR];
    for (int64_t r = 0; r < m; ++r) {
      std::copy(tile + r * NR, tile + (r + 1) * NR, row);
      if (drop.active()) drop.apply(i0 + r, j0, n, row);
      const T* pre_row = pre + (i0 + r) * hidden + j0;
      T* dst = dpre + (i0 + r) * hidden + j0;
      for (int64_t c = 0; c < n; c += kV) {
        const int64_t k = std::min(kV, n - c);
        const V x = k == kV ? load_acc(pre_row + c) : load_acc(pre_row + c, k);
        store_lanes(dst + c, V::loadu(row + c) * activation_value_grad<Act>(x).grad, k);
      }
    }
  }
};

// dg = dh * u * act'(g), du = dh * act(g), g and u read from the saved rows (row stride ld),
// dg and du written with row stride d_ld ([dg | du]: d_up = d_gate + F, d_ld = 2F).
template <typename T>
struct DgatedEpilogue {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const T *gate, *up;
  int64_t ld;
  T *d_gate, *d_up;
  int64_t d_ld;
  Activation act;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    dispatch_activation(act, [&](auto tag) { rows<decltype(tag)::value>(i0, j0, m, n, tile); });
  }
  template <Activation Act>
  void rows(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    constexpr int64_t NR = Blk<A>::kNR, kV = V::size();
    for (int64_t r = 0; r < m; ++r) {
      const T* g_row = gate + (i0 + r) * ld + j0;
      const T* u_row = up + (i0 + r) * ld + j0;
      T* dg_row = d_gate + (i0 + r) * d_ld + j0;
      T* du_row = d_up + (i0 + r) * d_ld + j0;
      for (int64_t c = 0; c < n; c += kV) {
        const int64_t k = std::min(kV, n - c);
        const V g = k == kV ? load_acc(g_row + c) : load_acc(g_row + c, k);
        const V u = k == kV ? load_acc(u_row + c) : load_acc(u_row + c, k);
        const V dh = V::loadu(tile + r * NR + c);
        const ValueGrad<V> a = activation_value_grad<Act>(g);
        store_lanes(dg_row + c, dh * u * a.grad, k);
        store_lanes(du_row + c, dh * a.value, k);
      }
    }
  }
};

// Weight and bias gradients: C is (rows, n_src [+ 1]); rows [0, split) go to (dw_top, db_top),
// rows [split, ...) to (dw_below, db_below); column n_src is the bias. Null pointers skip.
template <typename T>
struct ParamGradEpilogue {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  T *dw_top, *db_top, *dw_below, *db_below;
  int64_t split, n_src;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const A* tile) const {
    constexpr int64_t NR = Blk<A>::kNR, kV = V::size();
    const int64_t n_w = std::clamp<int64_t>(n_src - j0, 0, n);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = i0 + r;
      const bool top = i < split;
      T* dw = top ? dw_top : dw_below;
      T* db = top ? db_top : db_below;
      const int64_t row = top ? i : i - split;
      if (dw != nullptr) {
        for (int64_t c = 0; c < n_w; c += kV)
          store_lanes(dw + row * n_src + j0 + c, V::loadu(tile + r * NR + c), n_w - c);
      }
      if (db != nullptr && n_w < n) db[row] = static_cast<T>(tile[r * NR + n_w]);
    }
  }
};

// db[c] = sum over rows of S(r, c), for a bias whose weight needs no gradient.
template <typename T, class Src>
void column_sums(const Src& src, int64_t rows, int64_t cols, T* db) {
  using A = acc_t<T>;
  constexpr int64_t kChunk = 1024;  // columns per task: fits segment_buffer
  at::parallel_for(0, (cols + kChunk - 1) / kChunk, 1, [&](int64_t t0, int64_t t1) {
    A* const buf = segment_buffer<A>();
    double acc[kChunk];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * kChunk, n = std::min(kChunk, cols - c0);
      std::fill(acc, acc + n, 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        src.load(r, c0, n, buf);
        for (int64_t c = 0; c < n; ++c) acc[c] += buf[c];
      }
      for (int64_t c = 0; c < n; ++c) db[c0 + c] = static_cast<T>(acc[c]);
    }
  });
}

// Packing costs for the thread split (gemm_packed), in flops per element.
constexpr double kPlainCost = 8.0, kActCost = 40.0;

// ---- forward ---------------------------------------------------------------------------------
template <typename T>
void ffn_fwd_typed(const FfnArgs& a) {
  using A = acc_t<T>;
  const Activation act = static_cast<Activation>(a.activation);
  const int64_t N = a.tokens, D = a.d_model, F = a.hidden;
  const PlainSource<T> x_src{a.x, {}};
  T* const hidden = static_cast<T*>(a.hidden_buf);
  const A* b1 = a.b1 ? padded_param<T, Scratch::kFfnBias1>(a.b1, F) : nullptr;
  const A* b2 = a.b2 ? padded_param<T, Scratch::kFfnBias2>(a.b2, D) : nullptr;
  auto pack_x = [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
    pack_a_rows(x_src, dst, i0, m, k0, kc);
  };

  // GEMM1: pre (or h) = x W1^T + b1
  if (!(a.layers & kFfnFirst)) {
  } else if (a.gated) {
    const PlainSource<T> w_src{a.w1, a.w_up, F};
    const A* b_up = padded_param<T, Scratch::kFfnBiasUp>(a.b_up, F);
    const A* b_gate = b1 ? b1 : padded_param<T, Scratch::kFfnBias1>(nullptr, F);
    const InterleavedGateUp<A> cols{F};
    const GatedEpilogue<T> epi{hidden, F, b_gate, b_up, a.store_preactivation, act};
    gemm_packed<A>(N, 2 * round_up_to(F, Blk<A>::kNR / 2), D, kPlainCost, kPlainCost, pack_x,
                   [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
                     pack_b_cols(w_src, cols, dst, k0, kc, j0, n);
                   }, epi);
  } else {
    const PlainSource<T> w_src{a.w1, {}};
    auto pack_w = [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
      pack_b_cols(w_src, Identity{}, dst, k0, kc, j0, n);
    };
    if (a.store_preactivation) {
      gemm_packed<A>(N, F, D, kPlainCost, kPlainCost, pack_x, pack_w,
                     BiasEpilogue<T, false>{hidden, F, b1, Dropout(a)});
    } else {
      gemm_packed<A>(N, F, D, kPlainCost, kPlainCost, pack_x, pack_w,
                     BiasEpilogue<T, true>{hidden, F, b1, Dropout(a), act});
    }
  }

  // GEMM2: y = h W2^T + b2, h packed from what GEMM1 stored (or the given pre-activation)
  if (!(a.layers & kFfnSecond)) return;
  const PlainSource<T> w2_src{a.w2, {}};
  const T* saved = static_cast<const T*>(a.saved);
  auto pack_w2t = [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
    pack_b_cols(w2_src, Identity{}, dst, k0, kc, j0, n);
  };
  const BiasEpilogue<T, false> out_epi{static_cast<T*>(a.y), D, b2, Dropout(a)};
  auto run = [&](const auto& h_src, double cost) {
    gemm_packed<A>(N, D, F, cost, kPlainCost,
                   [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
                     pack_a_rows(h_src, dst, i0, m, k0, kc);
                   }, pack_w2t, out_epi);
  };
  if (!a.store_preactivation) run(PlainSource<T>{contiguous_view<T>(hidden, F), {}}, kPlainCost);
  else if (a.gated) run(GatedSource<T>{saved, static_cast<const T*>(a.saved_up), a.saved_ld, act},
                        kActCost);
  else run(ActSource<T>{saved, F, act, Dropout(a)}, kActCost);
}

// ---- backward --------------------------------------------------------------------------------
template <typename T>
void ffn_bwd_typed(const FfnArgs& a) {
  using A = acc_t<T>;
  const Activation act = static_cast<Activation>(a.activation);
  const int64_t N = a.tokens, D = a.d_model, F = a.hidden;
  const int64_t H = a.gated ? 2 * F : F;  // columns of saved / d_hidden
  const T* saved = static_cast<const T*>(a.saved);
  T* const d_hidden = static_cast<T*>(a.d_hidden);
  const PlainSource<T> dy_src{a.dy, {}};
  const PlainSource<T> x_src{a.x, {}};

  // dW2 | db2 = dy^T [hd | 1]
  auto dw2 = [&](const auto& hd_src) {
    const int64_t cols = a.db2 ? F + 1 : F;
    gemm_packed<A>(D, cols, N, kPlainCost, kActCost,
                   [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
                     pack_a_cols(dy_src, dst, i0, m, k0, kc);
                   },
                   [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
                     pack_b_rows(hd_src, F, dst, k0, kc, j0, n);
                   },
                   ParamGradEpilogue<T>{static_cast<T*>(a.dw2), static_cast<T*>(a.db2), nullptr,
                                        nullptr, D, F});
  };
  const T* saved_up = static_cast<const T*>(a.saved_up);
  const bool second = a.layers & kFfnSecond, first = a.layers & kFfnFirst;
  if (!second) {
  } else if (a.dw2 != nullptr) {
    if (a.gated) dw2(GatedSource<T>{saved, saved_up, a.saved_ld, act});
    else dw2(ActSource<T>{saved, F, act, Dropout(a)});
  } else if (a.db2 != nullptr) {
    column_sums(dy_src, N, D, static_cast<T*>(a.db2));
  }

  const bool need_dw1 = a.dw1 != nullptr || a.dw_up != nullptr;
  const bool need_db1 = a.db1 != nullptr || a.db_up != nullptr;
  const bool need_first = first && (a.dx != nullptr || need_dw1 || need_db1);
  if (!need_first && (first || a.d_hidden == nullptr)) return;

  // d_hidden = (dy W2) with act' (and the gate product) fused into the epilogue
  const PlainSource<T> w2_src{a.w2, {}};
  auto pack_dy = [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
    pack_a_rows(dy_src, dst, i0, m, k0, kc);
  };
  auto pack_w2 = [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
    pack_b_rows(w2_src, F, dst, k0, kc, j0, n);
  };
  if (!second) {
  } else if (a.gated) {
    gemm_packed<A>(N, F, D, kPlainCost, kPlainCost, pack_dy, pack_w2,
                   DgatedEpilogue<T>{saved, saved_up, a.saved_ld, d_hidden,
                                     static_cast<T*>(a.d_up), a.d_ld, act});
  } else {
    gemm_packed<A>(N, F, D, kPlainCost, kPlainCost, pack_dy, pack_w2,
                   DpreEpilogue<T>{saved, d_hidden, F, Dropout(a), act});
  }
  if (!need_first) return;
  // d_hidden: contiguous here ([d gate | d up] gated, the given gradient of a kFfnFirst call)
  const PlainSource<T> dh_src{contiguous_view<T>(d_hidden, H), {}};

  // dx = d_hidden [W1 ; W_up]
  if (a.dx != nullptr) {
    const PlainSource<T> w_src{a.w1, a.w_up, a.gated ? F : std::numeric_limits<int64_t>::max()};
    gemm_packed<A>(N, D, H, kPlainCost, kPlainCost,
                   [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
                     pack_a_rows(dh_src, dst, i0, m, k0, kc);
                   },
                   [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
                     pack_b_rows(w_src, D, dst, k0, kc, j0, n);
                   },
                   BiasEpilogue<T, false>{static_cast<T*>(a.dx), D, nullptr, Dropout(a)});
  }

  // dW1 | db1 = d_hidden^T [x | 1]   (gated rows: [gate units ; up units])
  if (need_dw1) {
    gemm_packed<A>(H, need_db1 ? D + 1 : D, N, kPlainCost, kPlainCost,
                   [&](A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
                     pack_a_cols(dh_src, dst, i0, m, k0, kc);
                   },
                   [&](A* dst, int64_t k0, int64_t kc, int64_t j0, int64_t n) {
                     pack_b_rows(x_src, D, dst, k0, kc, j0, n);
                   },
                   ParamGradEpilogue<T>{static_cast<T*>(a.dw1), static_cast<T*>(a.db1),
                                        static_cast<T*>(a.dw_up), static_cast<T*>(a.db_up), F, D});
  } else if (need_db1) {
    if (a.db1 != nullptr) column_sums(dh_src, N, F, static_cast<T*>(a.db1));
    if (a.db_up != nullptr) {
      const PlainSource<T> up_src{contiguous_view<T>(a.d_up, H), {}};
      column_sums(up_src, N, F, static_cast<T*>(a.db_up));
    }
  }
}

}  // namespace

void ffn_fwd(const FfnArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { ffn_fwd_typed<decltype(tag)>(args); });
}

void ffn_bwd(const FfnArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { ffn_bwd_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
