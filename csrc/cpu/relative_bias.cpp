// DeBERTa's disentangled relative-position bias on CPU: a gather forward, a scatter-add backward
// (semantics: fastformer/reference/relative_bias.py; the op: fastformer/ops/relative_bias.py).
//
// c2p (B, H, Lq, W) and p2c (B, H, Lk, W), contiguous, either may be absent: the attention's
// content rows against its 2S relative-position embeddings (W = 2S). Index tables ci, pi
// (Lq, Lk) in [0, W) (int32 here); visible (Bv, Lq, Lk) bool with Bv in {1, B}, or absent (all visible).
//   forward   out[b,h,i,j]    = visible[b,i,j] ? c2p[b,h,i,ci[i,j]] + p2c[b,h,j,pi[i,j]] : -inf
//   backward  dc2p[b,h,i,c]   = sum over visible j with ci[i,j] = c of dout[b,h,i,j]
//             dp2c[b,h,j,c]   = sum over visible i with pi[i,j] = c of dout[b,h,i,j]
// Sums in fp32 (fp64 for fp64), each output rounded once.
//
// torch.gather on these shapes ran ~28 ms per (4, 12, 512, 512) bf16 gather on 2 Zen 5 cores
// (it copies the expanded index). Here a forward row gathers its c2p entries from its c2p row (W
// values, L1) and one p2c entry per key from the (b, h) slab of p2c, kLanes keys per vector
// gather (AVX2 / AVX-512; fp32 and bf16, the index tables narrowed to int32 by the binding), and
// writes Lk values once. The slab is read from a per-task copy whose rows are a line longer: at
// W = 512 the tensor's rows, 1-2 KB apart, map to 2-4 of L1's 64 sets, and a query row's 512 p2c
// lines evicted each other. Measured at that shape (2 Zen 5 cores, both terms and a padding mask,
// one process, the scalar loop vs these): forward bf16 9.2-9.6 -> 4.9 ms (the c2p term alone
// 6.0 -> 2.0, the p2c term 7.7 -> 3.1; the gathers without the copy left the p2c term at 8 ms),
// fp32 24-26 -> 17-20 ms (writing a fresh 50 MB output, its pages faulted in, is most of that);
// backward (both terms) bf16 11.4 -> 8.7 ms, fp32 40 -> 20 ms. In a DeBERTa-v3-base-style model
// (bf16, 12 layers, 4 x 512 tokens) with the attention backward's bias gradient written in its
// dtype (bindings/attention.h): inference 740 -> 691 ms, training step 2383 -> 2078 ms.
//
// Parallel: the forward over (b, h) slabs (split into row blocks when there are fewer slabs than
// twice the threads; a row writes only its own output row), dc2p over (b, h, i) rows; dp2c over
// (b, h, strip of kStrip keys): the task reads its strip of every dout row and accumulates into
// kStrip rows of dp2c held in fp32 in the task (kStrip * (W + 16) * 4 bytes: 132 KB at W = 512),
// so no two tasks write the same dp2c row; AVX-512 adds kLanes keys' gradients at a time, one
// gather and one scatter, each lane in its own row.
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

// ---- vector gathers (AVX2: 8 lanes, AVX512: 16) ------------------------------------------------
// fp32 and bf16 rows are gathered by index; a bf16 value is the low half of the dword gathered at
// its own address, which reads 2 bytes past it: the kernels keep the vector path off each tensor's
// last element (see fwd_vector_end). fp16 and fp64 take the scalar loops.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kLanes = 16;
using IdxReg = __m512i;
using LaneMask = __mmask16;
inline IdxReg load_idx(const int32_t* p) { return _mm512_loadu_si512(p); }
inline IdxReg add_idx(IdxReg a, IdxReg b) { return _mm512_add_epi32(a, b); }
inline IdxReg lane_times(int64_t step) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(step)));
}
inline LaneMask all_lanes() { return static_cast<LaneMask>(0xffff); }
inline LaneMask visible_lanes(const bool* v) {
  return _mm_cmpneq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)), _mm_setzero_si128());
}
template <typename T>
inline __m512 gather(const T* base, IdxReg idx, LaneMask m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, base, 4);
  } else {
    const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base, 2);
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}
inline __m512 where(LaneMask m, __m512 v, __m512 fill) { return _mm512_mask_blend_ps(m, fill, v); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kLanes = 8;
using IdxReg = __m256i;
using LaneMask = __m256i;  // all ones in a visible lane
inline IdxReg load_idx(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IdxReg add_idx(IdxReg a, IdxReg b) { return _mm256_add_epi32(a, b); }
inline IdxReg lane_times(int64_t step) {
  return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(step)));
}
inline LaneMask all_lanes() { return _mm256_set1_epi32(-1); }
inline LaneMask visible_lanes(const bool* v) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  return _mm256_cmpgt_epi32(bytes, _mm256_setzero_si256());
}
template <typename T>
inline __m256 gather(const T* base, IdxReg idx, LaneMask m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, idx, _mm256_castsi256_ps(m), 4);
  } else {
    const __m256i w = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(base),
                                                  idx, m, 2);
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}
inline __m256 where(LaneMask m, __m256 v, __m256 fill) { return _mm256_blendv_ps(fill, v, _mm256_castsi256_ps(m)); }
#endif

template <typename T>
constexpr bool kGathered =
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// Keys [0, end) of forward row r take the vector path; the rest the scalar loop. A bf16 gather
// reads the 2 bytes after each value: past the tensor for the last element of c2p, whose row
// (the last) stays scalar (p2c's are read from the task's padded copy).
template <typename T>
int64_t fwd_vector_end(const RelativeBiasArgs& a, int64_t r) {
  if (std::is_same_v<T, c10::BFloat16> && a.c2p && r == a.B * a.H * a.Lq - 1) return 0;
  return a.Lk / kLanes * kLanes;
}
#endif

template <typename T>
void relative_bias_fwd_typed(const RelativeBiasArgs& a) {
  using A = acc_t<T>;
  const int64_t Lq = a.Lq, Lk = a.Lk, W = a.W, heads = a.B * a.H;
  const T* c2p = static_cast<const T*>(a.c2p);
  const T* p2c = static_cast<const T*>(a.p2c);
  T* out = static_cast<T*>(a.out);
  const T masked = static_cast<T>(-std::numeric_limits<A>::infinity());
  // Tasks: (b, h) slabs, split into row blocks only when there are too few slabs for the threads.
  const int64_t row_blocks = std::clamp<int64_t>(2 * at::get_num_threads() / std::max<int64_t>(heads, 1), 1,
                                                 std::max<int64_t>(Lq / 64, 1));
  const int64_t block_rows = (Lq + row_blocks - 1) / row_blocks;
  // Row i reads one p2c entry from each of the Lk rows of its slab. Rows W * sizeof(T) bytes
  // apart (1-2 KB at W = 512) fall into 2-4 of L1's 64 sets, where the 512 lines a query row
  // touches evict each other: the task copies its slab with rows a line longer first (a
  // bf16 gather reads 2 bytes past its value: the padding keeps that inside the copy).
  const bool pad_p2c = p2c != nullptr;
  const int64_t p_stride = pad_p2c ? W + kLine / static_cast<int64_t>(sizeof(T)) : W;
  at::parallel_for(0, heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p_copy(pad_p2c ? Lk * p_stride : 0);
    int64_t copied = -1;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / row_blocks, b = bh / a.H;
      const int64_t i0 = (t % row_blocks) * block_rows, i1 = std::min(Lq, i0 + block_rows);
      const T* p_slab = p2c ? p2c + bh * Lk * W : nullptr;
      if (pad_p2c) {
        if (copied != bh) {
          for (int64_t j = 0; j < Lk; ++j) std::memcpy(p_copy.data() + j * p_stride, p_slab + j * W, W * sizeof(T));
          copied = bh;
        }
        p_slab = p_copy.data();
      }
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = bh * Lq + i;
        const int32_t* ci = a.c2p_index + i * Lk;
        const int32_t* pi = a.p2c_index + i * Lk;
        const bool* vis = a.visible ? a.visible + ((a.Bv == 1 ? 0 : b) * Lq + i) * Lk : nullptr;
        const T* c_row = c2p ? c2p + r * W : nullptr;
        T* o = out + r * Lk;
        // The row reads c_row backwards (the relative position falls as j rises), which the
        // hardware prefetcher does not follow: fetch the next row's W values ahead ((4, 12, 512,
        // 512) bf16, both terms, 2 Zen 5 cores, scalar loop: 19 ms without, 12 ms with).
        if (c_row) {
          for (int64_t k = 0; k < W; k += kLine / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(c_row + W + k);
        }
        int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
        if constexpr (kGathered<T>) {
          // kLanes keys at a time: the c2p entries gathered from the row, the p2c entries from
          // kLanes consecutive p2c rows (lane l: row j + l, column pi[j + l]); hidden lanes are
          // not read and become -inf. Same sum and rounding as the scalar loop.
          const IdxReg p_rows = lane_times(p_stride);
          const auto minus_inf = Vectorized<float>(-std::numeric_limits<float>::infinity());
          for (const int64_t vec_end = fwd_vector_end<T>(a, r); j < vec_end; j += kLanes) {
            const LaneMask m = vis ? visible_lanes(vis + j) : all_lanes();
            auto v = Vectorized<float>(0.0f);
            if (c_row) v = v + Vectorized<float>(gather(c_row, load_idx(ci + j), m));
            if (p_slab) v = v + Vectorized<float>(gather(p_slab + j * p_stride, add_idx(load_idx(pi + j), p_rows), m));
            store_acc(o + j, Vectorized<float>(where(m, v, minus_inf)));
          }
        }
#endif
        for (; j < Lk; ++j) {
          if (vis && !vis[j]) {
            o[j] = masked;
            continue;
          }
          A v = 0;
          if (c_row) v += static_cast<A>(c_row[ci[j]]);
          if (p_slab) v += static_cast<A>(p_slab[j * p_stride + pi[j]]);
          o[j] = static_cast<T>(v);
        }
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
      const int32_t* ci = a.c2p_index + i * Lk;
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
#if defined(CPU_CAPABILITY_AVX512)
    const IdxReg acc_rows = lane_times(stride);
#endif
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / strips, j0 = (t % strips) * kStrip, b = bh / a.H;
      const int64_t n = std::min(kStrip, Lk - j0);
      std::fill(acc.begin(), acc.begin() + n * stride, A(0));
      for (int64_t i = 0; i < Lq; ++i) {
        const int32_t* pi = a.p2c_index + i * Lk + j0;
        const bool* vis = a.visible ? a.visible + ((a.Bv == 1 ? 0 : b) * Lq + i) * Lk + j0 : nullptr;
        const T* g = dout + (bh * Lq + i) * Lk + j0;
        int64_t jj = 0;
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (kGathered<T>) {
          // kLanes keys at a time: lane l adds its gradient into its own row's accumulator
          // (row jj + l, column pi[jj + l]): a gather, an add and a scatter with no two lanes
          // on one address. Same additions, in the same order, as the scalar loop.
          for (; jj + kLanes <= n; jj += kLanes) {
            const LaneMask m = vis ? visible_lanes(vis + jj) : all_lanes();
            const IdxReg at = add_idx(load_idx(pi + jj), add_idx(acc_rows, _mm512_set1_epi32(static_cast<int>(jj * stride))));
            const __m512 sum = _mm512_add_ps(gather(acc.data(), at, m), load_acc(g + jj));
            _mm512_mask_i32scatter_ps(acc.data(), m, at, sum, 4);
          }
        }
#endif
        for (; jj < n; ++jj) {
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
