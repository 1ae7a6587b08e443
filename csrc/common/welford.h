// Welford / Chan running statistics: the per-row mean and variance of add+norm.
//
// A state holds (count, mean, m2) with m2 = sum((x - mean)^2). Elements are pushed one at a
// time (welford_push) and partial states are combined with Chan's parallel formula
// (welford_merge), so any split of a row (vector lanes on CPU, threads and warps on GPU) gives
// the same statistics up to rounding, without the catastrophic cancellation of sum(x^2) - n*m^2.
//
// The templates work for `float`/`double` and for vector types with +,-,* (at::vec::Vectorized),
// which is how the CPU kernel keeps one state per SIMD lane and merges the lanes at the end.
#pragma once
#include "ff_common.h"

namespace fastformer {

template <typename T>
struct WelfordState {
  T count;  // number of elements pushed (as T, so lanes and threads use one type)
  T mean;
  T m2;     // sum of squared deviations from `mean`
};

// Push x into (mean, m2) whose count was just incremented; inv_count = 1 / new count.
template <typename V>
FF_HOST_DEVICE void welford_push(V& mean, V& m2, const V& x, const V& inv_count) {
  V delta = x - mean;
  mean = mean + delta * inv_count;
  m2 = m2 + delta * (x - mean);
}

// Chan et al.: combine the statistics of two disjoint sets of elements.
template <typename T>
FF_HOST_DEVICE WelfordState<T> welford_merge(const WelfordState<T>& a, const WelfordState<T>& b) {
  T count = a.count + b.count;
  if (count == T(0)) return a;
  T delta = b.mean - a.mean;
  T b_frac = b.count / count;
  return {count, a.mean + delta * b_frac, a.m2 + b.m2 + delta * delta * a.count * b_frac};
}

// Chan's merge for the common case of k states that all hold `count` elements (SIMD lanes that
// saw the same number of elements): the mean is the mean of the means and
//   m2 = sum of the m2s + count * sum over states of (mean_l - mean)^2,
// which is what a tree of welford_merge calls computes, without a division per merge. The
// caller computes the mean first and the squared deviations from it (two passes over k values,
// no cancellation).
template <typename T>
FF_HOST_DEVICE WelfordState<T> welford_merge_equal(T count, T k, T mean, T sum_m2, T sum_sq_dev) {
  return {count * k, mean, sum_m2 + count * sum_sq_dev};
}

}  // namespace fastformer
