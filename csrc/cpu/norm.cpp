// Fused residual-add + LayerNorm / RMSNorm on CPU, forward and backward.
//
// Forward, one task per block of rows (at::parallel_for, grain ~32K elements), per row:
//   pass 1 (memory): z = x + residual, rounded to the input type exactly as eager `x + r` does,
//     written to `residual_out` when asked and to a row scratch in fp32 (L1/L2 resident);
//     statistics with one Welford state per SIMD lane (two lane sets to hide FMA latency),
//     merged with the shared Chan formulas (common/welford.h).
//   pass 2 (cache): y = (z - mean) * rstd * w + b, while prefetching the next row's inputs so
//     that its DRAM reads overlap this row's compute; outputs of >= 8 MB use streaming stores.
//   Memory traffic per element: read x, residual; write y (+ residual_out). Saved for the
//   backward: mean, rstd (4 bytes per row each), never x_hat.
//
// Backward, rows split into at most kMaxPartials fixed blocks (independent of the thread count,
// so results are bitwise identical for any number of threads), rows of a block in groups:
//   pass 1 (memory): recompute z (from residual_out, or x + residual) and x_hat; keep x_hat and
//     dy in the group scratch; row sums of g*x_hat and g, with g = dy * w.
//   pass 2 (cache): dz = (g - x_hat*c_xhat - c_g) * rstd (+ d residual_out).
//   Per group: column sums of dy*x_hat and dy in fp32, added to the block's fp64 partials; at
//   the end dw, db = ordered sum of the block partials. fp64 partials because at 4096 rows an
//   fp32 accumulation is off by ~5e-5 (eager PyTorch's fp32 LayerNorm dweight by 3e-4).
//   Traffic: read dy, z (or x and residual), write dz; dx and dresidual are the same tensor dz.
//
// The hot loops are instantiated per combination of optional inputs (residual, stored residual,
// d residual_out): a branch inside them costs more than the loop body (measured 1.4x).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/norm_math.h"
#include "common/welford.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kMaxPartials = 32;         // row blocks of the backward's dw/db reduction
constexpr int64_t kGroupElements = 32768;    // backward row group: dy and x_hat stay in L2
constexpr int64_t kMaxGroupRows = 8;
constexpr int64_t kElementsPerTask = 32768;  // parallel grain: enough work to pay a wake-up
// Outputs at least this large are written with streaming stores (no read-for-ownership);
// smaller ones stay in cache for the next op.
constexpr int64_t kStreamBytes = 8 << 20;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

template <bool kFull, typename T>
inline AccVec<T> load_n(const T* p, int64_t n) {
  if constexpr (kFull) return load_acc(p);
  else return load_acc(p, n);
}

// Call f(std::bool_constant<b>{}).
template <typename F>
inline void dispatch_bool(bool b, F&& f) {
  if (b) f(std::true_type{}); else f(std::false_type{});
}

// ---- forward ----------------------------------------------------------------------------------
template <typename T, bool kResidual, bool kStoreResidual>
struct FwdRow {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  static constexpr int64_t kV = V::size();

  // z for elements [j, j + n) into scratch (and residual_out); returns it.
  template <bool kFull>
  static inline V make_z(const T* x_row, const T* r_row, T* res_out_row, A* z, int64_t j, int64_t n) {
    V zv = load_n<kFull>(x_row + j, n);
    if constexpr (kResidual) {
      zv = round_to<T>(zv + load_n<kFull>(r_row + j, n));
      if constexpr (kStoreResidual) store_acc(res_out_row + j, zv, kFull ? kV : n);
    }
    zv.store(z + j);
    return zv;
  }

  // Pass 1 for one row: fills z, returns (mean, rstd).
  static inline void stats(const T* x_row, const T* r_row, T* res_out_row, A* z, int64_t H,
                           bool rms, A eps, A& mean, A& rstd) {
    const int64_t n_pair = H / (2 * kV) * (2 * kV);
    const A inv_h = A(1) / static_cast<A>(H);
    int64_t j = 0;
    if (rms) {
      V sq0(A(0)), sq1(A(0));
      for (; j < n_pair; j += 2 * kV) {
        const V z0 = make_z<true>(x_row, r_row, res_out_row, z, j, kV);
        const V z1 = make_z<true>(x_row, r_row, res_out_row, z, j + kV, kV);
        sq0 = at::vec::fmadd(z0, z0, sq0);
        sq1 = at::vec::fmadd(z1, z1, sq1);
      }
      for (; j < H; j += kV) {  // zero-filled tail lanes add 0
        const V zv = H - j >= kV ? make_z<true>(x_row, r_row, res_out_row, z, j, kV)
                                 : make_z<false>(x_row, r_row, res_out_row, z, j, H - j);
        sq0 = at::vec::fmadd(zv, zv, sq0);
      }
      mean = A(0);
      rstd = A(1) / std::sqrt(reduce_add(sq0 + sq1) * inv_h + eps);
      return;
    }
    V mean0(A(0)), m2_0(A(0)), mean1(A(0)), m2_1(A(0));
    A count = 0;
    for (; j < n_pair; j += 2 * kV) {
      const V z0 = make_z<true>(x_row, r_row, res_out_row, z, j, kV);
      const V z1 = make_z<true>(x_row, r_row, res_out_row, z, j + kV, kV);
      count += 1;
      const V inv_count(A(1) / count);
      welford_push(mean0, m2_0, z0, inv_count);
      welford_push(mean1, m2_1, z1, inv_count);
    }
    for (int64_t t = j; t < H; t += kV) {
      if (H - t >= kV) make_z<true>(x_row, r_row, res_out_row, z, t, kV);
      else make_z<false>(x_row, r_row, res_out_row, z, t, H - t);
    }
    // The two lane sets (same count) merge lane-wise, the kV lanes (same count) with the
    // equal-count form of Chan's merge, then the leftover elements are pushed one by one.
    WelfordState<A> st{A(0), A(0), A(0)};
    if (count > 0) {
      const V lane_mean = (mean0 + mean1) * V(A(0.5));
      const V d01 = mean1 - mean0;
      const V lane_m2 = m2_0 + m2_1 + d01 * d01 * V(count * A(0.5));
      const A mean_all = reduce_add(lane_mean) / A(kV);
      const V dev = lane_mean - V(mean_all);
      st = welford_merge_equal(A(2) * count, A(kV), mean_all, reduce_add(lane_m2),
                               reduce_add(dev * dev));
    }
    for (; j < H; ++j) {
      st.count += 1;
      welford_push(st.mean, st.m2, z[j], A(1) / st.count);
    }
    mean = st.mean;
    rstd = A(1) / std::sqrt(st.m2 * inv_h + eps);
  }

  static void run(const NormFwdArgs& a, const A* w, const A* b, bool stream_y, int64_t begin,
                  int64_t end) {
    const int64_t H = a.hidden;
    A* const z = thread_scratch<A, Scratch::kNormRows>(round_up(H, kV));
    const T* const x = static_cast<const T*>(a.x);
    const T* const res = static_cast<const T*>(a.residual);
    T* const y = static_cast<T*>(a.y);
    T* const res_out = static_cast<T*>(a.residual_out);
    A* const mean_out = static_cast<A*>(a.mean);
    A* const rstd_out = static_cast<A*>(a.rstd);
    const A eps = static_cast<A>(a.eps);
    const int64_t n_full = H / kV * kV;
    const T* x_row = x + a.x_rows.offset(begin);
    const T* r_row = kResidual ? res + a.residual_rows.offset(begin) : nullptr;
    for (int64_t row = begin; row < end; ++row) {
      A mean, rstd;
      stats(x_row, r_row, kStoreResidual ? res_out + row * H : nullptr, z, H, a.rms, eps, mean,
            rstd);
      if (mean_out) mean_out[row] = mean;
      rstd_out[row] = rstd;

      // Pass 2, prefetching the next row (the current one again on the last row).
      const bool more = row + 1 < end;
      const T* x_next = more ? x + a.x_rows.offset(row + 1) : x_row;
      const T* r_next = kResidual ? (more ? res + a.residual_rows.offset(row + 1) : r_row) : nullptr;
      T* const y_row = y + row * H;
      const V mean_v(mean), rstd_v(rstd);
      int64_t j = 0;
      for (; j < n_full; j += kV) {
        __builtin_prefetch(x_next + j);
        if constexpr (kResidual) __builtin_prefetch(r_next + j);
        const V out = norm_affine(norm_x_hat(V::loadu(z + j), mean_v, rstd_v), V::loadu(w + j),
                                  V::loadu(b + j));
        if (stream_y) stream_acc(y_row + j, out); else store_acc(y_row + j, out);
      }
      if (j < H) {
        const V out = norm_affine(norm_x_hat(V::loadu(z + j), mean_v, rstd_v), V::loadu(w + j),
                                  V::loadu(b + j));
        store_acc(y_row + j, out, H - j);
      }
      x_row = x_next;
      r_row = r_next;
    }
    stream_fence();
  }
};

template <typename T>
void add_norm_fwd_typed(const NormFwdArgs& a) {
  using A = acc_t<T>;
  constexpr int64_t kV = Vectorized<A>::size();
  const int64_t H = a.hidden;
  const int64_t H_pad = round_up(H, kV);
  A* const w = thread_scratch<A, Scratch::kNormWeight>(H_pad);
  A* const b = thread_scratch<A, Scratch::kNormBias>(H_pad);
  std::fill(w + H, w + H_pad, A(0));
  std::fill(b + H, b + H_pad, A(0));
  load_param(a.weight, a.param_dtype, H, w, A(1));
  load_param(a.bias, a.param_dtype, H, b, A(0));
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(H, 1));
  const bool stream_y = a.rows * H * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
  dispatch_bool(a.residual != nullptr, [&](auto has_res) {
    dispatch_bool(a.residual_out != nullptr, [&](auto store_res) {
      using Row = FwdRow<T, has_res.value, has_res.value && store_res.value>;
      at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
        Row::run(a, w, b, stream_y, begin, end);
      });
    });
  });
}

// ---- backward ---------------------------------------------------------------------------------
// acc[0:size] += v, widened to fp64.
template <typename A>
inline void add_to_f64(double* acc, const Vectorized<A>& v) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    const __m256 f = v;
    _mm256_storeu_pd(acc, _mm256_add_pd(_mm256_loadu_pd(acc), _mm256_cvtps_pd(_mm256_castps256_ps128(f))));
    _mm256_storeu_pd(acc + 4, _mm256_add_pd(_mm256_loadu_pd(acc + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    const __m512 f = v;
    _mm512_storeu_pd(acc, _mm512_add_pd(_mm512_loadu_pd(acc), _mm512_cvtps_pd(_mm512_castps512_ps256(f))));
    _mm512_storeu_pd(acc + 8, _mm512_add_pd(_mm512_loadu_pd(acc + 8),
                                            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)))));
    return;
  }
#endif
  A lanes[Vectorized<A>::size()];
  v.store(lanes);
  for (int64_t l = 0; l < Vectorized<A>::size(); ++l) acc[l] += static_cast<double>(lanes[l]);
}

template <typename T, bool kZb, bool kDres>
struct BwdBlock {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  static constexpr int64_t kV = V::size();

  // One row: x_hat and dy into scratch (pass 1), dz (pass 2).
  static inline void row(const NormBwdArgs& a, const A* w, int64_t row, A* xh, A* dyk,
                         bool stream_dz) {
    const int64_t H = a.hidden;
    const int64_t n_full = H / kV * kV;
    const T* dy_row = static_cast<const T*>(a.dy) + a.dy_rows.offset(row);
    const T* za_row = static_cast<const T*>(a.z_a) + a.z_a_rows.offset(row);
    const T* zb_row = kZb ? static_cast<const T*>(a.z_b) + a.z_b_rows.offset(row) : nullptr;
    const A* mean_in = static_cast<const A*>(a.mean);
    const V mean_v(mean_in ? mean_in[row] : A(0));
    const V rstd_v(static_cast<const A*>(a.rstd)[row]);
    const A inv_h = A(1) / static_cast<A>(H);

    // Pass 1. Tail lanes have dy = 0 and contribute nothing to the sums.
    V sum_gx(A(0)), sum_g(A(0));
    auto pass1 = [&](auto full, int64_t j, int64_t n) {
      V zv = load_n<full.value>(za_row + j, n);
      if constexpr (kZb) zv = round_to<T>(zv + load_n<full.value>(zb_row + j, n));
      const V dyv = load_n<full.value>(dy_row + j, n);
      const V x_hat = norm_x_hat(zv, mean_v, rstd_v);
      const V g = dyv * V::loadu(w + j);
      x_hat.store(xh + j);
      dyv.store(dyk + j);
      sum_gx = at::vec::fmadd(g, x_hat, sum_gx);
      sum_g = sum_g + g;
    };
    int64_t j = 0;
    for (; j < n_full; j += kV) pass1(std::true_type{}, j, kV);
    if (j < H) pass1(std::false_type{}, j, H - j);
    const V c_xhat(reduce_add(sum_gx) * inv_h);
    const V c_g(a.rms ? A(0) : reduce_add(sum_g) * inv_h);

    // Pass 2, prefetching the next row's inputs (the current one again on the last row).
    const bool more = row + 1 < a.rows;
    const T* dy_next = more ? static_cast<const T*>(a.dy) + a.dy_rows.offset(row + 1) : dy_row;
    const T* za_next = more ? static_cast<const T*>(a.z_a) + a.z_a_rows.offset(row + 1) : za_row;
    const T* zb_next = kZb ? (more ? static_cast<const T*>(a.z_b) + a.z_b_rows.offset(row + 1) : zb_row) : nullptr;
    const T* dro_row = kDres ? static_cast<const T*>(a.dresidual_out) + a.dresidual_out_rows.offset(row) : nullptr;
    T* dz_row = static_cast<T*>(a.dz) + row * H;
    for (j = 0; j < n_full; j += kV) {
      __builtin_prefetch(dy_next + j);
      __builtin_prefetch(za_next + j);
      if constexpr (kZb) __builtin_prefetch(zb_next + j);
      V d = norm_dz(V::loadu(dyk + j) * V::loadu(w + j), V::loadu(xh + j), c_xhat, c_g, rstd_v);
      if constexpr (kDres) d = d + load_acc(dro_row + j);
      if (stream_dz) stream_acc(dz_row + j, d); else store_acc(dz_row + j, d);
    }
    if (j < H) {
      V d = norm_dz(V::loadu(dyk + j) * V::loadu(w + j), V::loadu(xh + j), c_xhat, c_g, rstd_v);
      if constexpr (kDres) d = d + load_acc(dro_row + j, H - j);
      store_acc(dz_row + j, d, H - j);
    }
  }

  static void run(const NormBwdArgs& a, const A* w, int64_t rows_per_block, int64_t group,
                  double* dw_part, double* db_part, int64_t blk_begin, int64_t blk_end) {
    const int64_t H_pad = round_up(a.hidden, kV);
    const bool stream_dz = a.rows * a.hidden * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
    A* const x_hat = thread_scratch<A, Scratch::kNormRows>(group * H_pad);
    A* const dy_rows = thread_scratch<A, Scratch::kNormDyRows>(group * H_pad);
    for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
      double* dw_acc = dw_part ? dw_part + blk * H_pad : nullptr;
      double* db_acc = db_part ? db_part + blk * H_pad : nullptr;
      if (dw_acc) std::fill(dw_acc, dw_acc + H_pad, 0.0);
      if (db_acc) std::fill(db_acc, db_acc + H_pad, 0.0);
      const int64_t row_end = std::min(a.rows, (blk + 1) * rows_per_block);
      for (int64_t row0 = blk * rows_per_block; row0 < row_end; row0 += group) {
        const int64_t n_rows = std::min(group, row_end - row0);
        for (int64_t k = 0; k < n_rows; ++k)
          row(a, w, row0 + k, x_hat + k * H_pad, dy_rows + k * H_pad, stream_dz);
        if (!dw_acc && !db_acc) continue;
        // Column sums of the group into the block's fp64 partials, kCols vectors at a time:
        // one accumulator chain per column vector would wait on FMA latency (30% of the
        // backward at (512, 768), measured).
        constexpr int64_t kCols = 4;
        int64_t j = 0;
        for (; j + kCols * kV <= H_pad; j += kCols * kV) {
          V sw[kCols], sb[kCols];
          for (int64_t c = 0; c < kCols; ++c) sw[c] = sb[c] = V(A(0));
          for (int64_t k = 0; k < n_rows; ++k) {
            for (int64_t c = 0; c < kCols; ++c) {
              const V dyv = V::loadu(dy_rows + k * H_pad + j + c * kV);
              sw[c] = at::vec::fmadd(dyv, V::loadu(x_hat + k * H_pad + j + c * kV), sw[c]);
              sb[c] = sb[c] + dyv;
            }
          }
          for (int64_t c = 0; c < kCols; ++c) {
            if (dw_acc) add_to_f64(dw_acc + j + c * kV, sw[c]);
            if (db_acc) add_to_f64(db_acc + j + c * kV, sb[c]);
          }
        }
        for (; j < H_pad; j += kV) {
          V sw(A(0)), sb(A(0));
          for (int64_t k = 0; k < n_rows; ++k) {
            const V dyv = V::loadu(dy_rows + k * H_pad + j);
            sw = at::vec::fmadd(dyv, V::loadu(x_hat + k * H_pad + j), sw);
            sb = sb + dyv;
          }
          if (dw_acc) add_to_f64(dw_acc + j, sw);
          if (db_acc) add_to_f64(db_acc + j, sb);
        }
      }
    }
    stream_fence();
  }
};

template <typename T>
void add_norm_bwd_typed(const NormBwdArgs& a) {
  using A = acc_t<T>;
  constexpr int64_t kV = Vectorized<A>::size();
  const int64_t H = a.hidden;
  const int64_t H_pad = round_up(H, kV);
  const bool need_dw = a.dweight != nullptr, need_db = a.dbias != nullptr;
  A* const w = thread_scratch<A, Scratch::kNormWeight>(H_pad);
  std::fill(w + H, w + H_pad, A(0));
  load_param(a.weight, a.param_dtype, H, w, A(1));

  const int64_t n_blocks_max = std::min<int64_t>(std::max<int64_t>(a.rows, 1), kMaxPartials);
  const int64_t rows_per_block = (a.rows + n_blocks_max - 1) / n_blocks_max;
  const int64_t n_blocks = a.rows == 0 ? 0 : (a.rows + rows_per_block - 1) / rows_per_block;
  double* const dw_part = need_dw ? thread_scratch<double, Scratch::kNormDweightParts>(n_blocks * H_pad) : nullptr;
  double* const db_part = need_db ? thread_scratch<double, Scratch::kNormDbiasParts>(n_blocks * H_pad) : nullptr;
  // Rows of a block go in groups whose dy and x_hat stay in scratch: dw/db then cost one fp32
  // column sum and one fp64 add per group instead of one fp64 add per row.
  const int64_t group = std::clamp<int64_t>(kGroupElements / H_pad, 1, kMaxGroupRows);
  dispatch_bool(a.z_b != nullptr, [&](auto has_zb) {
    dispatch_bool(a.dresidual_out != nullptr, [&](auto has_dres) {
      using Block = BwdBlock<T, has_zb.value, has_dres.value>;
      at::parallel_for(0, n_blocks, 1, [&](int64_t blk_begin, int64_t blk_end) {
        Block::run(a, w, rows_per_block, group, dw_part, db_part, blk_begin, blk_end);
      });
    });
  });

  // Ordered reduction of the block partials, parallel over columns.
  auto reduce_partials = [&](const double* part, void* out) {
    double* const total = thread_scratch<double, Scratch::kNormColumnTotals>(H_pad);
    std::fill(total, total + H_pad, 0.0);
    at::parallel_for(0, H_pad, 1024, [&](int64_t c0, int64_t c1) {
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const double* part_row = part + blk * H_pad;
        for (int64_t c = c0; c < c1; ++c) total[c] += part_row[c];
      }
    });
    store_param(out, a.param_dtype, H, total);
  };
  if (need_dw) reduce_partials(dw_part, a.dweight);
  if (need_db) reduce_partials(db_part, a.dbias);
}

}  // namespace

void add_norm_fwd(const NormFwdArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { add_norm_fwd_typed<decltype(tag)>(args); });
}

void add_norm_bwd(const NormBwdArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { add_norm_bwd_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
