// The operands of csrc/cpu/ffn.cpp's packed GEMMs: sources (the rows the GEMM operands are
// packed from: plain rows, act(pre) * keep with dropout's Philox mask, act(g) * u of a gated
// pre-activation) and packers (A / B panels in gemm_packed.h's layouts, the gated GEMM's
// interleaved gate / up columns). The elementwise work of the FFN happens here, while packing,
// so no pass over an (N, F) tensor exists on its own: each value is read once per panel.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "common/activations.h"
#include "common/philox.h"
#include "cpu/act_vec.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm_packed.h"
#include "cpu/philox_vec.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace ffn_operands {

template <typename A>
using Blk = PackedBlocking<A>;

// ---- sources: rows of the matrices the GEMM operands are packed from ------------------------
// Every source writes round_up(n, kV) values for load(r, c0, n, dst): the n asked for, then
// zeros to the vector boundary (act(0) = 0 for every activation, so tails stay zero).

template <typename T, typename A = acc_t<T>>
inline void load_segment(const T* src, int64_t col_stride, int64_t n, A* dst) {
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  int64_t c = 0;
  if (col_stride == 1) {
    for (; c + kV <= n; c += kV) load_acc(src + c).store(dst + c);
    if (c < n) load_acc(src + c, n - c).store(dst + c);
    return;
  }
  for (; c < n; ++c) dst[c] = static_cast<A>(src[c * col_stride]);
  for (; c % kV != 0; ++c) dst[c] = A(0);
}

// A matrix given by a MatView, optionally stacked on a second one along rows (rows >= split
// come from `below`): [Wg ; Wu] is one source.
template <typename T>
struct PlainSource {
  using A = acc_t<T>;
  MatView top, below;
  int64_t split = std::numeric_limits<int64_t>::max();

  const T* row(int64_t r) const {
    if (r < split) return static_cast<const T*>(top.ptr) + top.rows.offset(r);
    return static_cast<const T*>(below.ptr) + below.rows.offset(r - split);
  }
  int64_t col_stride(int64_t r) const { return r < split ? top.col_stride : below.col_stride; }
  void load(int64_t r, int64_t c0, int64_t n, A* dst) const {
    load_segment(row(r) + c0 * col_stride(r), col_stride(r), n, dst);
  }
  // Row r's values in place when the packers may read them so (fp32, unit column stride), else
  // null: the packers then transpose straight from the source instead of staging a copy.
  const A* direct(int64_t r) const {
    if constexpr (std::is_same_v<T, float>) {
      if (col_stride(r) == 1) return row(r);
    }
    return nullptr;
  }
};

template <typename T>
MatView contiguous_view(const void* ptr, int64_t ld) {
  MatView v;
  v.ptr = ptr;
  v.rows.strides[0] = ld;
  return v;
}

// Dropout of the hidden activation: keep[n][f] = Philox(seed, offset + n * F + f) >= threshold.
struct Dropout {
  double p = 0.0;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  int64_t hidden = 0;

  explicit Dropout(const FfnArgs& a)
      : p(a.dropout_p), seed(a.seed), offset(a.offset),
        threshold(a.dropout_p > 0 ? dropout_threshold(a.dropout_p) : 0), hidden(a.hidden) {}
  bool active() const { return p > 0; }
  // v[c] *= keep(r, c0 + c) / (1 - p) for c < n.
  template <typename A>
  void apply(int64_t r, int64_t c0, int64_t n, A* v) const {
    const A scale = static_cast<A>(1.0 / (1.0 - p));
    const uint64_t base = offset + static_cast<uint64_t>(r * hidden + c0);
    constexpr int64_t kChunk = 256;
    uint32_t words[kChunk];
    for (int64_t c_begin = 0; c_begin < n; c_begin += kChunk) {
      const int64_t m = std::min(kChunk, n - c_begin);
      philox_words(base + static_cast<uint64_t>(c_begin), seed, m, words);
      A* chunk = v + c_begin;
      for (int64_t c = 0; c < m; ++c) chunk[c] = words[c] >= threshold ? chunk[c] * scale : A(0);
    }
  }
};

// The activation is a run-time value everywhere below: it is switched on once per packed
// segment or epilogue tile (hundreds of elements), so the GEMM drivers are instantiated once per
// dtype instead of once per (dtype, activation), which cut this file's compile time ~3x.
template <typename A>
inline void activate_in_place(Activation act, A* v, int64_t n) {
  using V = Vectorized<A>;
  dispatch_activation(act, [&](auto tag) {
    for (int64_t c = 0; c < n; c += V::size()) activation<decltype(tag)::value>(V::loadu(v + c)).store(v + c);
  });
}

// hd = act(pre) * keep / (1 - p), from the saved pre-activation (N, F) contiguous.
template <typename T>
struct ActSource {
  using A = acc_t<T>;
  const T* pre;
  int64_t hidden;
  Activation act;
  Dropout drop;
  void load(int64_t r, int64_t c0, int64_t n, A* dst) const {
    load_segment(pre + r * hidden + c0, 1, n, dst);
    activate_in_place(act, dst, n);
    if (drop.active()) drop.apply(r, c0, n, dst);
  }
};

// h = act(g) * u, from the saved gate and up rows (row stride ld: 2F for [g | u]).
template <typename T>
struct GatedSource {
  using A = acc_t<T>;
  const T *gate, *up;
  int64_t ld;
  Activation act;
  void load(int64_t r, int64_t c0, int64_t n, A* dst) const {
    using V = Vectorized<A>;
    constexpr int64_t kV = V::size();
    const T* g = gate + r * ld + c0;
    const T* u = up + r * ld + c0;
    dispatch_activation(act, [&](auto tag) {
      for (int64_t c = 0; c < n; c += kV) {
        const int64_t k = std::min(kV, n - c);
        const V gv = k == kV ? load_acc(g + c) : load_acc(g + c, k);
        const V uv = k == kV ? load_acc(u + c) : load_acc(u + c, k);
        (activation<decltype(tag)::value>(gv) * uv).store(dst + c);
      }
    });
  }
};

// ---- packers (layouts: gemm_packed.h) ----------------------------------------------------------
// Row buffer of one thread: the longest segment a packer loads, plus vector slack.
template <typename A>
inline A* segment_buffer() {
  return thread_scratch<A, Scratch::kFfnSegment>(std::max(Blk<A>::kNC, Blk<A>::kKC) + 2 * Blk<A>::kNR);
}

// Sources with direct(r) (PlainSource) may be read in place; the others compute their rows.
template <class Src, class = void>
struct ReadsInPlace : std::false_type {};
template <class Src>
struct ReadsInPlace<Src, std::void_t<decltype(std::declval<const Src&>().direct(0))>>
    : std::true_type {};

// Row r of the source in place (fp32 rows of unit stride of a source with direct()), else null.
template <typename A, class Src>
const A* direct_row(const Src& src, int64_t r) {
  if constexpr (ReadsInPlace<Src>::value && std::is_same_v<A, float>) return src.direct(r);
  (void)src, (void)r;
  return nullptr;
}

// The W rows of one panel, values [k0, k0 + kc) of source rows rows_of(0 .. W) (< 0: zeros):
// read in place where the source allows, else staged (load() into row i of the stage).
template <typename A, int64_t W, class Src, class RowOf>
void panel_rows(const Src& src, const RowOf& rows_of, int64_t k0, int64_t kc, const A** ptrs) {
  constexpr int64_t ld = Blk<A>::kKC + 2 * Blk<A>::kNR;  // + the vector tail of load()
  A* const stage = thread_scratch<A, Scratch::kFfnStage>(W * ld);
  for (int64_t i = 0; i < W; ++i) {
    const int64_t r = rows_of(i);
    if (r < 0) {
      ptrs[i] = zero_row<A>(Blk<A>::kKC);
    } else if (const A* row = direct_row<A>(src, r)) {
      ptrs[i] = row + k0;
    } else {
      src.load(r, k0, kc, stage + i * ld);
      ptrs[i] = stage + i * ld;
    }
  }
}

// Row r's values [c0, c0 + n) as width / P pieces of P values, piece p at out + p * stride; the
// values past n zero, except a one at index `one` (>= 0: the bias-gradient column). Whole pieces
// are copied from the source where it reads in place, the rest staged in buf (its load()).
template <typename A, int64_t P, class Src>
void put_row_panels(const Src& src, int64_t r, int64_t c0, int64_t n, int64_t width, int64_t one,
                    A* buf, A* out, int64_t stride) {
  const A* row = n > 0 ? direct_row<A>(src, r) : nullptr;
  int64_t p = 0;
  if (row != nullptr) {
    for (; (p + 1) * P <= n && (one < 0 || one >= (p + 1) * P); ++p)
      std::copy(row + c0 + p * P, row + c0 + (p + 1) * P, out + p * stride);
    if (p * P >= width) return;
    std::copy(row + c0 + p * P, row + c0 + std::max(n, p * P), buf + p * P);
  } else if (n > 0) {
    src.load(r, c0, n, buf);
  }
  std::fill(buf + std::max(n, p * P), buf + width, A(0));
  if (one >= 0) buf[one] = A(1);
  for (; p * P < width; ++p) std::copy(buf + p * P, buf + (p + 1) * P, out + p * stride);
}

// op(A)[i][k] = S(i, k), by 8 x 8 register transposes of the panel's MR rows (read in place:
// 0.3-0.5 ns per element, where staging each row and storing it one value at a time took 0.5-1.4;
// fp32, one thread, 2-core Zen 3, alternating runs).
template <typename A, class Src>
void pack_a_rows(const Src& src, A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
  constexpr int64_t MR = Blk<A>::kMR;
  for (int64_t p = 0; p * MR < m; ++p) {
    const A* ptrs[MR];
    panel_rows<A, MR>(src, [&](int64_t r) { return p * MR + r < m ? i0 + p * MR + r : -1; }, k0, kc, ptrs);
    put_transposed_panel<A, MR>(ptrs, kc, dst + p * kc * MR);
  }
}

// op(A)[i][k] = S(k, i): a transposed source, read along its rows.
template <typename A, class Src>
void pack_a_cols(const Src& src, A* dst, int64_t i0, int64_t m, int64_t k0, int64_t kc) {
  constexpr int64_t MR = Blk<A>::kMR;
  A* const buf = segment_buffer<A>();
  const int64_t width = round_up_to(m, MR);
  for (int64_t k = 0; k < kc; ++k)
    put_row_panels<A, MR>(src, k0 + k, i0, m, width, -1, buf, dst + k * MR, kc * MR);
}

// op(B)[k][j] = S(k, j) for j < n_src; column n_src (the bias-gradient column) is all ones.
template <typename A, class Src>
void pack_b_rows(const Src& src, int64_t n_src, A* dst, int64_t k0, int64_t kc, int64_t j0,
                 int64_t n) {
  constexpr int64_t NR = Blk<A>::kNR;
  A* const buf = segment_buffer<A>();
  const int64_t width = round_up_to(n, NR);
  const int64_t n_load = std::clamp<int64_t>(n_src - j0, 0, n);
  const int64_t ones = n_src >= j0 && n_src < j0 + n ? n_src - j0 : -1;
  for (int64_t k = 0; k < kc; ++k)
    put_row_panels<A, NR>(src, k0 + k, j0, n_load, width, ones, buf, dst + k * NR, kc * NR);
}

// op(B)[k][j] = S(source_row(j), k): a transposed source (weights as W^T); source_row(j) < 0
// is a zero column. Written with 8 x 8 register transposes, of the NR source rows read in place
// where the source allows (fp32 rows of unit stride), else staged (kc contiguous values each,
// converted or computed). Writing the panel one column at a time (stride NR) cost ~1.5 ns per
// element, the staged transpose ~1.05 (fp32, a (11008 x 4096) W, one thread); GEMM1 at (4096,
// 768, 3072), 2 threads, 20 alternating pairs: median 187 -> 181 ms. Read in place, 0.3-0.5 ns
// per element against 0.6-1.1 staged ((5632 | 32000) x 2048 and (2048 x 5632) fp32 W, one
// thread, 2-core Zen 3, alternating runs).
template <typename A, class Src, class RowOf>
void pack_b_cols(const Src& src, const RowOf& source_row, A* dst, int64_t k0, int64_t kc,
                 int64_t j0, int64_t n) {
  constexpr int64_t NR = Blk<A>::kNR;
  for (int64_t q = 0; q * NR < n; ++q) {
    const A* ptrs[NR];
    panel_rows<A, NR>(src, [&](int64_t c) { return q * NR + c < n ? source_row(j0 + q * NR + c) : -1; },
                      k0, kc, ptrs);
    put_transposed_panel<A, NR>(ptrs, kc, dst + q * kc * NR);
  }
}

// Gated GEMM1 columns: panel q holds units [q*NR/2, (q+1)*NR/2), gate in lanes [0, NR/2) and up
// in [NR/2, NR); source rows [0, F) of [Wg ; Wu] are gate units, [F, 2F) up units.
template <typename A>
struct InterleavedGateUp {
  int64_t hidden;
  int64_t operator()(int64_t j) const {
    constexpr int64_t NR = Blk<A>::kNR, kHalf = NR / 2;
    const int64_t unit = (j / NR) * kHalf + j % kHalf;
    if (unit >= hidden) return -1;
    return (j % NR) >= kHalf ? hidden + unit : unit;
  }
};

struct Identity {
  int64_t operator()(int64_t j) const { return j; }
};

}  // namespace ffn_operands
}  // namespace fastformer::cpu::CPU_CAPABILITY
