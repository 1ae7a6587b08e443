// ff.linear_cross_entropy on CPU: the row pass over one chunk of logits, and the compensated
// bf16 accumulation of d weight. The chunk loop and its GEMMs (torch's at::mm: oneDNN / MKL,
// bf16 on AVX512-BF16 / AMX) run in fastformer/reference/linear_cross_entropy.py, which states
// the whole algorithm and its memory traffic; the semantics are its `rows()`.
//
// lce_rows, per row r of a (rows, V) chunk z (contiguous, the input dtype T), target t = t_r,
// eps = label_smoothing, s_j = cap * tanh(z_j / cap) with a softcap (else s_j = z_j):
//   ignored (t == ignore_index): loss = lse = 0, gradient row = 0.
//   loss:  m = softcap(max_j z_j) (softcap is increasing, so this is max_j s_j);
//          lse = m + log sum_j exp(s_j - m);  loss = lse - (1 - eps) s_t - (eps / V) sum_j s_j
//   grad:  dz_j = f (exp(s_j - lse) - eps / V - (1 - eps) [j == t]) (1 - (s_j / cap)^2),
//          f = grad_scale * row_scale_r, written over z_j in T (in place).
// One task per block of rows (at::parallel_for); per row, three sweeps over z, the row held in
// L1/L2 (V = 32000: 128 KB fp32, 64 KB bf16): the max; the exp sum (and the sum of s for
// label smoothing); the gradient. exp() is recomputed in the third sweep rather than stored:
// at 16 lanes per vector it costs ~1 cycle per element, against ~d = 1000 FMAs per element in
// the chunk's three GEMMs. With a softcap tanh (cpu/vec_math.h) is recomputed the same way.
// Traffic per chunk: read z once from memory (then L2), write dz once.
//
// The bias gradient (dbias, fp64 (V,)) adds the column sums of the written gradient: one more
// read of the chunk, split into column blocks so that each column is summed over the rows in
// order by one task (bitwise the same for any thread count).
//
// lce_pair_add: hi + lo += p elementwise for bf16 / fp16 (t = hi + lo + p in fp32; hi = t
// rounded; lo = (t - hi) rounded): the (hi, lo) pair carries ~16 significant bits, so d weight
// accumulates the chunks' bf16 partial products without a rounding to bf16 per chunk, in the
// memory of one fp32 buffer and with no separate output copy at the end. The first addition
// into the pair does not read lo (read_lo = false: nothing there yet, no zero fill) and the
// last does not write it (write_lo = false: hi = round(t), the result).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kElementsPerTask = 32768;  // parallel grain: enough work to pay a wake-up
constexpr int64_t kBiasColumns = 256;        // column block of the bias-gradient sums

template <typename A>
inline Vectorized<A> vexp(const Vectorized<A>& x) {
  if constexpr (std::is_same_v<A, float>) return x.exp_u20();  // 2 ulp; exp() is 1 ulp
  else return x.exp();
}

template <typename T>
void lce_rows_typed(const LceRowsArgs& a) {
  using A = acc_t<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t kV = Vec::size();
  const int64_t n = a.vocab;
  const int64_t full = n / kV * kV;
  T* logits = static_cast<T*>(a.logits);
  A* loss = static_cast<A*>(a.loss);
  A* lse = static_cast<A*>(a.lse);
  const A* row_scale = static_cast<const A*>(a.row_scale);
  const bool capped = a.softcap > 0.0;
  const A cap = capped ? static_cast<A>(a.softcap) : A(1);
  const A inv_cap = capped ? static_cast<A>(1.0 / a.softcap) : A(1);
  const bool smoothing = a.label_smoothing > 0.0;
  const A eps_per_class = static_cast<A>(a.label_smoothing / static_cast<double>(n));
  const A target_weight = static_cast<A>(1.0 - a.label_smoothing);
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const A neg_inf = -std::numeric_limits<A>::infinity();

  auto capv = [&](const Vec& z) { return capped ? Vec(cap) * fast_tanh(z * Vec(inv_cap)) : z; };
  auto caps = [&](A z) { return capped ? cap * std::tanh(z * inv_cap) : z; };
  // d s / d z = 1 - tanh^2 = 1 - (s / cap)^2
  auto dcapv = [&](const Vec& s) {
    const Vec u = s * Vec(inv_cap);
    return Vec(A(1)) - u * u;
  };
  auto dcaps = [&](A s) {
    const A u = s * inv_cap;
    return A(1) - u * u;
  };

  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(n, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = logits + r * n;
      const int64_t t = a.target[r];
      if (t == a.ignore_index) {
        if (a.compute_loss) {
          loss[r] = A(0);
          lse[r] = A(0);
        }
        if (a.write_grad) std::memset(static_cast<void*>(row), 0, n * sizeof(T));  // +0 is all-zero bits
        continue;
      }
      // The Python layer validated the targets; a stray one gives NaN, never a wild read.
      const bool in_range = t >= 0 && t < n;
      const A z_t = in_range ? to_acc(row[t]) : nan;
      A row_lse;
      if (a.compute_loss) {
        Vec vmax(neg_inf);
        for (int64_t j = 0; j < full; j += kV) vmax = at::vec::maximum(vmax, load_acc(row + j));
        A m = at::vec::vec_reduce_all<A>(
            [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
        for (int64_t j = full; j < n; ++j) m = std::max(m, to_acc(row[j]));
        const A m_s = caps(m);
        Vec vsum(A(0)), vs(A(0));
        for (int64_t j = 0; j < full; j += kV) {
          const Vec s = capv(load_acc(row + j));
          vsum = vsum + vexp(s - Vec(m_s));
          if (smoothing) vs = vs + s;
        }
        A sum = reduce_add(vsum), sum_s = reduce_add(vs);
        for (int64_t j = full; j < n; ++j) {
          const A s = caps(to_acc(row[j]));
          sum += std::exp(s - m_s);
          sum_s += s;
        }
        row_lse = m_s + std::log(sum);
        A l = row_lse - target_weight * caps(z_t);
        if (smoothing) l -= eps_per_class * sum_s;
        loss[r] = l;
        lse[r] = row_lse;
      } else {
        row_lse = lse[r];
      }
      if (a.write_grad) {
        const A f = static_cast<A>(a.grad_scale) * (row_scale ? row_scale[r] : A(1));
        const Vec vf(f), vlse(row_lse), veps(eps_per_class);
        for (int64_t j = 0; j < full; j += kV) {
          const Vec s = capv(load_acc(row + j));
          Vec g = vexp(s - vlse) - veps;
          if (capped) g = g * dcapv(s);
          store_acc(row + j, g * vf);
        }
        for (int64_t j = full; j < n; ++j) {
          const A s = caps(to_acc(row[j]));
          A g = std::exp(s - row_lse) - eps_per_class;
          if (capped) g *= dcaps(s);
          row[j] = static_cast<T>(g * f);
        }
        if (in_range) {  // the one-hot term, from the value read before the row was overwritten
          const A s = caps(z_t);
          A g = std::exp(s - row_lse) - eps_per_class - target_weight;
          if (capped) g *= dcaps(s);
          row[t] = static_cast<T>(g * f);
        } else {
          for (int64_t j = 0; j < n; ++j) row[j] = static_cast<T>(nan);
        }
      }
    }
  });

  if (a.dbias == nullptr || !a.write_grad) return;
  double* dbias = static_cast<double*>(a.dbias);
  const int64_t blocks = (n + kBiasColumns - 1) / kBiasColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) A acc[kBiasColumns];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBiasColumns, width = std::min(kBiasColumns, n - c0);
      const int64_t vec_width = width / kV * kV;
      std::fill(acc, acc + width, A(0));
      for (int64_t r = 0; r < a.rows; ++r) {
        const T* row = logits + r * n + c0;
        for (int64_t j = 0; j < vec_width; j += kV)
          (Vec::loadu(acc + j) + load_acc(row + j)).store(acc + j);
        for (int64_t j = vec_width; j < width; ++j) acc[j] += to_acc(row[j]);
      }
      for (int64_t j = 0; j < width; ++j) dbias[c0 + j] += static_cast<double>(acc[j]);
    }
  });
}

template <typename T>
void pair_add_typed(const PairAddArgs& a) {
  using A = acc_t<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t kV = Vec::size();
  T* hi = static_cast<T*>(a.hi);
  T* lo = static_cast<T*>(a.lo);
  const T* p = static_cast<const T*>(a.p);
  const bool read_lo = a.read_lo, write_lo = a.write_lo;
  at::parallel_for(0, a.n, kElementsPerTask, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kV <= end; i += kV) {
      Vec t = load_acc(hi + i) + load_acc(p + i);
      if (read_lo) t = t + load_acc(lo + i);
      const Vec h = round_to<T>(t);
      store_acc(hi + i, h);
      if (write_lo) store_acc(lo + i, t - h);
    }
    for (; i < end; ++i) {
      A t = to_acc(hi[i]) + to_acc(p[i]);
      if (read_lo) t += to_acc(lo[i]);
      const T h = static_cast<T>(t);
      hi[i] = h;
      if (write_lo) lo[i] = static_cast<T>(t - to_acc(h));
    }
  });
}

}  // namespace

void lce_rows(const LceRowsArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { lce_rows_typed<decltype(tag)>(args); });
}

void lce_pair_add(const PairAddArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { pair_add_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
