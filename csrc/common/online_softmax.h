// Online softmax (Milakov & Gimelshein; FlashAttention): the per-row state of a flash attention
// kernel, updated one block of keys at a time, shared by the CPU and CUDA kernels.
//
// State per query row after the blocks seen so far: row_max m, row_sum l = sum_j exp(s_j - m),
// and the output accumulator acc = sum_j exp(s_j - m) v_j. For a new block with maximum
// block_max:
//   m' = max(m, block_max)          alpha = exp(m - m')       (0 when m = -inf)
//   l' = alpha * l + sum_block exp(s_j - m')   acc' = alpha * acc + sum_block exp(s_j - m') v_j
// At the end: out = acc / l, lse = m + log(l). A row that saw only -inf scores (every key
// masked) keeps m = -inf and l = 0: out = 0 and lse = +inf, so the backward's
// P = exp(s - lse) is exactly 0 for it (no NaN anywhere).
//
// Scores are in natural-log units (scale already applied). The CPU and CUDA flash kernels use
// exp2 with log2(e) folded into the scale (the *_log2 helpers below: scores, m and the shift are
// then in log2 units, p = exp2(s - shift)) and convert m to natural units for the lse.
#pragma once
#include <math.h>

#include "ff_common.h"

namespace fastformer {

// The value subtracted from scores before exponentiation: m' itself, or 0 while the row has
// seen only -inf (so exp(-inf - 0) = 0 instead of exp(-inf - -inf) = NaN).
template <typename T>
FF_HOST_DEVICE T softmax_shift(T row_max) {
  return row_max == -INFINITY ? T(0) : row_max;
}

// alpha = exp(m_old - m_new): the factor that rescales the running sum and accumulator.
template <typename T>
FF_HOST_DEVICE T online_softmax_alpha(T m_old, T m_new) {
  return m_old == -INFINITY ? T(0) : static_cast<T>(exp(m_old - m_new));
}

// 1 / l for the final normalization, 0 for rows with no allowed key.
template <typename T>
FF_HOST_DEVICE T softmax_inv_sum(T row_sum) {
  return row_sum > T(0) ? T(1) / row_sum : T(0);
}

// lse = m + log(l) (natural log), +inf for rows with no allowed key.
template <typename T>
FF_HOST_DEVICE T softmax_lse(T row_max, T row_sum) {
  return row_sum > T(0) ? row_max + static_cast<T>(log(row_sum)) : static_cast<T>(INFINITY);
}

// ---- log2 domain: s2 = s * log2(e), so exp(s - m) = exp2(s2 - m2) ----------------------------
constexpr double kLog2e = 1.4426950408889634;  // log2(e): multiply natural-log scores by it
constexpr double kLn2 = 0.6931471805599453;    // ln(2): back to natural-log units

// online_softmax_alpha with every quantity in log2 units: exp2(m_old - m_new), 0 when m_old = -inf.
template <typename T>
FF_HOST_DEVICE T online_softmax_alpha_log2(T m_old, T m_new) {
  return m_old == -INFINITY ? T(0) : static_cast<T>(exp2(m_old - m_new));
}

// softmax_lse from a row maximum in log2 units: the natural-log lse = m2 * ln(2) + log(l),
// +inf for rows with no allowed key.
template <typename T>
FF_HOST_DEVICE T softmax_lse_log2(T row_max_log2, T row_sum) {
  return row_sum > T(0) ? row_max_log2 * T(kLn2) + static_cast<T>(log(row_sum))
                        : static_cast<T>(INFINITY);
}

// Joins a sink logit (log2 units: one more term of the denominator, with no value) into a
// finished row's running max and sum; returns the factor its accumulator is rescaled by (1
// when the sink does not move the max; 0 for a row that saw no key).
template <typename T>
FF_HOST_DEVICE T softmax_join_sink_log2(T& row_max, T& row_sum, T sink) {
  if (sink > row_max) {
    const T alpha = online_softmax_alpha_log2(row_max, sink);
    row_sum = row_sum * alpha + T(1);
    row_max = sink;
    return alpha;
  }
  row_sum += static_cast<T>(exp2(sink - row_max));
  return T(1);
}

}  // namespace fastformer
