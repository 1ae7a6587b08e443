// SIMD helpers shared by the CPU kernels: load/store any element type (f32, f64, bf16, f16) as
// vectors of its accumulation type (f64 for f64, f32 otherwise), with partial-vector variants
// for row tails. Compiled once per capability level: Vectorized<float> is 8 lanes under AVX2,
// 16 under AVX512, and a scalar emulation under DEFAULT.
//
// Do not define static data with dynamic initialisers in files that include this header: they
// would run at load time, possibly on a CPU without the instructions they were compiled for.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/ff_common.h"
#include "cpu/scratch.h"

namespace fastformer::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T>
using AccVec = Vectorized<acc_t<T>>;
template <typename T>
constexpr bool is_reduced_v = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// Full vector: AccVec<T>::size() elements starting at p.
template <typename T>
inline AccVec<T> load_acc(const T* p) {
  if constexpr (is_reduced_v<T>) {
    AccVec<T> out;
    at::vec::load_to_float<T>(p, out);
    return out;
  } else {
    return AccVec<T>::loadu(p);
  }
}

// Partial vector: n < size() elements, the other lanes are zero.
template <typename T>
inline AccVec<T> load_acc(const T* p, int64_t n) {
  if constexpr (is_reduced_v<T>) {
    T tmp[AccVec<T>::size()];
    for (int64_t i = 0; i < AccVec<T>::size(); ++i) tmp[i] = i < n ? p[i] : T(0.0f);
    return load_acc(tmp);
  } else {
    return AccVec<T>::loadu(p, n);
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define FF_NATIVE_16BIT_CONVERT 1
#if defined(CPU_CAPABILITY_AVX2)
using FloatReg = __m256;   // one Vectorized<float>
using Packed16 = __m128i;  // Vectorized<float>::size() 16-bit values
inline void storeu_packed(void* p, Packed16 v) { _mm_storeu_si128(static_cast<__m128i*>(p), v); }
#else
using FloatReg = __m512;
using Packed16 = __m256i;
inline void storeu_packed(void* p, Packed16 v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
#endif
// fp32 -> bf16/fp16 with round-to-nearest-even, one float vector at a time.
template <typename T>
inline Packed16 pack16(const Vectorized<float>& v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return at::vec::cvtfp32_bf16(v);
  else return at::vec::cvtfp32_fp16(v);
}
template <typename T>
inline Vectorized<float> unpack16(Packed16 v) {
  FloatReg out;
  if constexpr (std::is_same_v<T, c10::BFloat16>) at::vec::cvtbf16_fp32(v, out);
  else at::vec::cvtfp16_fp32(v, out);
  return Vectorized<float>(out);
}
#endif

#ifdef FF_NATIVE_16BIT_CONVERT
// Round fp32 lanes to bf16 precision in place (RNE on the bits; NaN kept): 6 integer ops
// instead of a pack and an unpack.
inline Vectorized<float> round_bf16_fast(const Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return Vectorized<float>(_mm256_blendv_ps(_mm256_castsi256_ps(r), v, is_nan));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return Vectorized<float>(_mm512_mask_blend_ps(is_nan, _mm512_castsi512_ps(r), v));
#endif
}
#endif

// Store a full vector with a non-temporal (streaming) store when p is aligned for it: output
// streams much larger than the caches skip the read-for-ownership of every written line.
template <typename T>
inline void stream_acc(T* p, const AccVec<T>& v) {
#ifdef FF_NATIVE_16BIT_CONVERT
  constexpr size_t kBytes = sizeof(T) * AccVec<T>::size();
  if (reinterpret_cast<uintptr_t>(p) % kBytes == 0) {
    if constexpr (is_reduced_v<T>) {
#if defined(CPU_CAPABILITY_AVX2)
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack16<T>(v));
#else
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack16<T>(v));
#endif
    } else if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX2)
      _mm256_stream_ps(p, v);
#else
      _mm512_stream_ps(p, v);
#endif
    } else {
#if defined(CPU_CAPABILITY_AVX2)
      _mm256_stream_pd(p, v);
#else
      _mm512_stream_pd(p, v);
#endif
    }
    return;
  }
#endif
  v.store(p);
}

// Make streaming stores visible before the kernel returns.
inline void stream_fence() {
#ifdef FF_NATIVE_16BIT_CONVERT
  _mm_sfence();
#endif
}

template <typename T>
inline void store_acc(T* p, const AccVec<T>& v, int64_t n = AccVec<T>::size()) {
  if constexpr (is_reduced_v<T>) {
#ifdef FF_NATIVE_16BIT_CONVERT
    if (n == AccVec<T>::size()) {
      storeu_packed(p, pack16<T>(v));
      return;
    }
#endif
    at::vec::convert_from_float<T>(v, v).store(p, n);
  } else {
    if (n == AccVec<T>::size()) v.store(p); else v.store(p, n);
  }
}

// Round v to T's precision and back (emulates an eager op that produces a T tensor).
template <typename T>
inline AccVec<T> round_to(const AccVec<T>& v) {
  if constexpr (is_reduced_v<T>) {
#ifdef FF_NATIVE_16BIT_CONVERT
    if constexpr (std::is_same_v<T, c10::BFloat16>) return round_bf16_fast(v);
    return unpack16<T>(pack16<T>(v));
#else
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    (void)hi;
    return lo;
#endif
  } else {
    return v;
  }
}

template <typename T>
inline acc_t<T> to_acc(T v) { return static_cast<acc_t<T>>(v); }

template <typename A>
inline A reduce_add(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>([](Vectorized<A>& a, Vectorized<A>& b) { return a + b; }, v);
}

// sums[i] = the sum of v[i]'s lanes, for one vector's worth of vectors (the dot products of
// Vectorized::size() rows at once). fp32 at the AVX2 / AVX-512 levels: a transposing add tree
// of size - 1 shuffle pairs and adds (45 instructions for 16 vectors against ~7 per vector for
// reduce_add, whose shuffles each wait on the last); elsewhere reduce_add per vector.
template <typename A>
inline Vectorized<A> lane_sums(const Vectorized<A>* v) {
  using V = Vectorized<A>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s pair sums at 0, 2; v[2i+1]'s at 1, 3
      w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i .. 4i+3]
      x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // lanes (0 + 1, 2 + 3) of x[2i], then of x[2i+1]
      y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    __m256 w[4], x[2];
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
      x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
  }
#endif
  alignas(64) A sums[V::size()];
  for (int i = 0; i < V::size(); ++i) sums[i] = reduce_add(v[i]);
  return V::loadu(sums);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// Four rows of 8 floats -> cols[c] = rows 0..3 of column c (low half) and of column c + 4
// (high half): 4 unpacks and 4 shuffles. The first two stages of an 8 x 8 transpose
// (transpose_8x8) and all of a 4-row one (put_mr_panel in attention_common.h).
inline void transpose_4x8_halves(const __m256 rows[4], __m256 cols[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
  const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
  cols[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  cols[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  cols[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  cols[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}
#endif

// dst[c * ld_dst + r] = rows[r][c] for an 8 x 8 block, row r at rows[r] (any addresses). fp32
// at the AVX2 and AVX-512 levels: 8 ymm loads, 24 in-register shuffles, 8 stores. ATen's
// transpose_mxn<float, 8, 8> at its AVX-512 level runs its masked 16 x 16 kernel for an 8 x 8
// block: perf, fp32 attention (8, 12, 128, 64) forward, one thread: 10% of the samples in it,
// packing K^T.
template <typename A>
inline void transpose_8x8_rows(const A* const rows[8], A* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    __m256 r[8], s[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i]);
    transpose_4x8_halves(r, s);          // rows 0..3 of columns (c, c + 4)
    transpose_4x8_halves(r + 4, s + 4);  // rows 4..7
    for (int i = 0; i < 4; ++i) {  // column i from the low halves, column i + 4 from the high
      _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
    return;
  }
#endif
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < 8; ++r) dst[c * ld_dst + r] = rows[r][c];
}

// transpose_8x8_rows for rows at a stride: dst[c * ld_dst + r] = src[r * ld_src + c].
template <typename A>
inline void transpose_8x8(const A* src, int64_t ld_src, A* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    const A* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = src + i * ld_src;
    return transpose_8x8_rows(rows, dst, ld_dst);
  }
#endif
  at::vec::transpose_mxn<A, 8, 8>(src, ld_src, dst, ld_dst);
}

// dst[(k + c) * ld + g] = ptrs[g][k + c], for g < G (<= 8 rows) and c < 8: an 8 x 8 register
// transpose (rows past G: any readable ones, not stored).
template <typename A, int G>
inline void put_8_columns(const A* const* ptrs, int64_t k, A* dst, int64_t ld) {
  const A* rows[8];
  for (int i = 0; i < 8; ++i) rows[i] = ptrs[i < G ? i : 0] + k;
  if constexpr (G == 8) {
    transpose_8x8_rows<A>(rows, dst + k * ld, ld);
  } else {
    alignas(32) A cols[8 * 8];
    transpose_8x8_rows<A>(rows, cols, 8);
    for (int c = 0; c < 8; ++c) std::copy(cols + c * 8, cols + c * 8 + G, dst + (k + c) * ld);
  }
}

// panel[k * W + r] = ptrs[r][k] for r < W, k < kc: W rows (any addresses) as one W-wide
// transposed panel, the layout of the packed GEMM's panels and of attention's K^T / V^T blocks.
// 8 x 8 register transposes, the last kc % 8 values one at a time.
template <typename A, int64_t W>
void put_transposed_panel(const A* const* ptrs, int64_t kc, A* panel) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    for (int64_t g = 0; g + 8 <= W; g += 8) put_8_columns<A, 8>(ptrs + g, k, panel + g, W);
    if constexpr (W % 8 != 0) put_8_columns<A, W % 8>(ptrs + W / 8 * 8, k, panel + W / 8 * 8, W);
  }
  for (; k < kc; ++k)
    for (int64_t r = 0; r < W; ++r) panel[k * W + r] = ptrs[r][k];
}

// Dispatch a functor on the element type named by a DType.
template <typename F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); break;
    case DType::f64: f(double{}); break;
    case DType::bf16: f(c10::BFloat16{}); break;
    case DType::f16: f(c10::Half{}); break;
  }
}

// Read a parameter vector (weight/bias, f32 or the input type) into accumulation precision.
template <typename A>
inline void load_param(const void* src, DType src_dtype, int64_t n, A* dst, A fill) {
  if (src == nullptr) {
    for (int64_t i = 0; i < n; ++i) dst[i] = fill;
    return;
  }
  dispatch_dtype(src_dtype, [&](auto tag) {
    using P = decltype(tag);
    const P* s = static_cast<const P*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(static_cast<acc_t<P>>(s[i]));
  });
}

template <typename A>
inline void store_param(void* dst, DType dst_dtype, int64_t n, const A* src) {
  dispatch_dtype(dst_dtype, [&](auto tag) {
    using P = decltype(tag);
    P* d = static_cast<P*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<P>(src[i]);
  });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
