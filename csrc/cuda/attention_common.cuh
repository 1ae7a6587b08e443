// Pieces shared by the flash-attention kernels (attention_fwd.cu, attention_bwd.cu): tile
// copies into shared memory, the per-warp tensor-core GEMMs on 16-row strips, the masks (key
// padding, and the band that causality and the sliding window leave) and the score map (scale,
// softcap) both passes apply identically.
//
// Shared-memory tiles are row-major with rows kHeadDim + 8 (or kCols + 8) elements apart: the
// 16 extra bytes move each row 4 banks along, so the 8 row addresses of one ldmatrix phase
// land in distinct bank groups (conflict-free) without an XOR swizzle.
#pragma once
#include <math.h>

#include "common/online_softmax.h"
#include "common/softcap.h"
#include "cuda/cuda_kernels.h"
#include "cuda/mma.cuh"

namespace fastformer::cuda::attn {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int padded_stride(int cols) { return cols + 8; }

// First element of head h of batch b.
template <typename T>
__device__ __forceinline__ const T* head_ptr(const HeadsIn& t, int64_t b, int64_t h) {
  return static_cast<const T*>(t.data) + b * t.batch + h * t.head;
}
template <typename T>
__device__ __forceinline__ T* head_ptr(const HeadsOut& t, int64_t b, int64_t h) {
  return static_cast<T*>(t.data) + b * t.batch + h * t.head;
}

template <int D>
struct HeadDim {
  static constexpr int value = D;
};

// f(T{}, HeadDim<D>{}) for the compiled (dtype, head dim) pairs; callers check
// attention_supported() first.
template <typename F>
inline cudaError_t dispatch_attention(DType dtype, int head_dim, F&& f) {
  if (dtype == DType::bf16)
    return head_dim == 64 ? f(__nv_bfloat16{}, HeadDim<64>{}) : f(__nv_bfloat16{}, HeadDim<128>{});
  return head_dim == 64 ? f(__half{}, HeadDim<64>{}) : f(__half{}, HeadDim<128>{});
}

// d: key i + d is query i's diagonal (bottom-right alignment for causal 2, else top-left), the
// diagonal that causality (j <= i + d) and the window are aligned to.
__device__ __forceinline__ int causal_offset(const AttentionShape& s) {
  return s.causal == 2 ? s.len_k - s.len_q : 0;
}

// [first, end) of keys or query rows; empty when end <= first.
struct Range {
  int first, end;
};

// The pairs causality and the window allow: key j is visible to query i iff
// lo <= j - i <= hi (lo = d - window_left, hi = d + window_right, hi = d when causal).
// lo = -len_q and hi = len_k stand for "no limit" (no pair of the sequences lies beyond them),
// so both fit an int, and lo <= d <= hi.
struct Band {
  int lo, hi;

  __device__ __forceinline__ bool allows(int i, int j) const {
    const int r = j - i;
    return r >= lo && r <= hi;
  }
  // Some pair of rows [i0, i1] x keys [j0, j1] lies outside the band: the tile needs the
  // element mask (tiles the band covers wholly skip it).
  __device__ __forceinline__ bool cuts(int i0, int i1, int j0, int j1) const {
    return j1 - i0 > hi || j0 - i1 < lo;
  }
  __device__ __forceinline__ static int clip(int64_t x, int len) {
    return static_cast<int>(x < 0 ? 0 : x > len ? len : x);
  }
  // Keys [first, end) that some query row of [i0, i1] may see, clipped to [0, len_k) (empty:
  // end <= first). int64 inside: i1 + hi can pass 2^31 on sequences near the int limit.
  __device__ __forceinline__ Range keys_of_rows(int i0, int i1, int len_k) const {
    const int64_t first = static_cast<int64_t>(i0) + lo, end = static_cast<int64_t>(i1) + hi + 1;
    return {clip(first, len_k), static_cast<int>(end > len_k ? len_k : end)};
  }
  // Query rows [first, end) that may see some key of [j0, j1], clipped to [0, len_q).
  __device__ __forceinline__ Range rows_of_keys(int j0, int j1, int len_q) const {
    const int64_t first = static_cast<int64_t>(j0) - hi, end = static_cast<int64_t>(j1) - lo + 1;
    return {clip(first, len_q), static_cast<int>(end > len_q ? len_q : end)};
  }
};

__device__ __forceinline__ Band key_band(const AttentionShape& s) {
  const int64_t d = causal_offset(s);
  int64_t lo = -static_cast<int64_t>(s.len_q), hi = s.len_k;
  if (s.window_left >= 0 && d - s.window_left > lo) lo = d - s.window_left;
  if (s.window_right >= 0 && d + s.window_right < hi) hi = d + s.window_right;
  if (s.causal && d < hi) hi = d;
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

// A raw score q . k -> the exponent the softmax uses, in log2 units (common/online_softmax.h):
//   x = s scale log2(e)                           without softcap
//   x = c log2(e) tanh(s scale / c), t = tanh(.)  with softcap c (common/softcap.h)
// The forward and the backward (which recomputes P = exp2(x - lse log2(e))) call the same
// function, so they score identically.
struct ScoreMap {
  float mul;  // scale log2(e), or scale / c with softcap
  float cap;  // c log2(e); 0: no softcap

  __device__ __forceinline__ explicit ScoreMap(const AttentionShape& s)
      : mul(s.softcap > 0.f ? s.scale / s.softcap : s.scale * static_cast<float>(kLog2e)),
        cap(s.softcap > 0.f ? s.softcap * static_cast<float>(kLog2e) : 0.f) {}

  __device__ __forceinline__ bool softcapped() const { return cap != 0.f; }
  // x of raw score s; t receives tanh(s scale / c) with softcap (untouched without).
  __device__ __forceinline__ float operator()(float s, float& t) const {
    if (!softcapped()) return s * mul;
    t = softcap_tanh(s * mul);
    return cap * t;
  }
};

// Key j of batch b exists and is not padding.
__device__ __forceinline__ bool key_allowed(const AttentionShape& s, int64_t b, int j) {
  if (j >= s.len_k) return false;
  return s.key_padding == nullptr ||
         s.key_padding[b * s.key_padding_batch_stride + j * s.key_padding_key_stride] == 0;
}

// cp.async of rows [row0, row0 + kRows) of a (len, kCols) row-major global matrix into a
// (kRows, kCols + 8) smem tile; rows >= len are zero-filled. Called by all kThreads threads.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride,
                                                int row0, int len) {
  constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks
  static_assert((kRows * kChunksPerRow) % kThreads == 0, "tile must split evenly");
#pragma unroll
  for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
    const int chunk = i * kThreads + threadIdx.x;
    const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
    const bool valid = row0 + r < len;
    const T* src = valid ? gmem + (row0 + r) * row_stride + c : gmem;
    cp_async_16(smem + r * padded_stride(kCols) + c, src, valid);
  }
}

// ---- fragments (see mma.cuh for the layouts) -------------------------------------------------
// A = rows [0, 16), cols [k0, k0 + 16) of a row-major smem matrix s.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* s, int stride, int k0, int lane) {
  ldmatrix_x4(a, s + (lane % 16) * stride + k0 + (lane / 16) * 8);
}

// A = the transpose of s: A[m][k] = s[k][m], m in [0, 16), k in [k0, k0 + 16).
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* s, int stride, int k0,
                                             int lane) {
  ldmatrix_x4_trans(a, s + (k0 + (lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 8);
}

// B of the n8 tiles n0 and n0 + 8 (b[0..1] and b[2..3]), k in [k0, k0 + 16), where B[k][n] =
// s[n][k] (s holds B transposed, e.g. K for S = Q K^T).
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s, int stride, int n0, int k0,
                                          int lane) {
  ldmatrix_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * stride + k0 + ((lane >> 3) & 1) * 8);
}

// As load_b_nk with B[k][n] = s[k][n] (e.g. V for O = P V).
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s, int stride, int n0, int k0,
                                          int lane) {
  ldmatrix_x4_trans(b,
                    s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + n0 + (lane >> 4) * 8);
}

// The C fragments of columns [16 ks, 16 ks + 16) of a 16-row fp32 strip, rounded to T, as an A
// fragment (k = those columns).
template <typename T, int kTiles>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[kTiles][4], int ks) {
  a[0] = pack2<T>(c[2 * ks][0], c[2 * ks][1]);
  a[1] = pack2<T>(c[2 * ks][2], c[2 * ks][3]);
  a[2] = pack2<T>(c[2 * ks + 1][0], c[2 * ks + 1][1]);
  a[3] = pack2<T>(c[2 * ks + 1][2], c[2 * ks + 1][3]);
}

// ---- warp GEMMs on a 16-row strip, fp32 accumulators acc[n tile][4] --------------------------
// acc (16 x kN) += A (16 x kK) B, A = rows of row-major smem sA, B[k][n] = sB[n][k].
template <typename T, int kN, int kK>
__device__ __forceinline__ void gemm_smem_a_bt(float (&acc)[kN / 8][4], const T* sA, int a_stride,
                                               const T* sB, int b_stride, int lane) {
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[4];
    load_a(a, sA, a_stride, ks * 16, lane);
#pragma unroll
    for (int n2 = 0; n2 < kN / 16; ++n2) {
      uint32_t b[4];
      load_b_nk(b, sB, b_stride, n2 * 16, ks * 16, lane);
      mma_16816<T>(acc[2 * n2], a, b[0], b[1]);
      mma_16816<T>(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// Same with A already in registers (a[k step][4]).
template <typename T, int kN, int kK>
__device__ __forceinline__ void gemm_reg_a_bt(float (&acc)[kN / 8][4],
                                              const uint32_t (&a)[kK / 16][4], const T* sB,
                                              int b_stride, int lane) {
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
#pragma unroll
    for (int n2 = 0; n2 < kN / 16; ++n2) {
      uint32_t b[4];
      load_b_nk(b, sB, b_stride, n2 * 16, ks * 16, lane);
      mma_16816<T>(acc[2 * n2], a[ks], b[0], b[1]);
      mma_16816<T>(acc[2 * n2 + 1], a[ks], b[2], b[3]);
    }
  }
}

// acc (16 x kN) += P (16 x kK) B, P = fp32 C fragments rounded to T, B = row-major smem sB.
template <typename T, int kN, int kK>
__device__ __forceinline__ void gemm_c_b(float (&acc)[kN / 8][4], const float (&p)[kK / 8][4],
                                         const T* sB, int b_stride, int lane) {
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[4];
    c_to_a<T>(a, p, ks);
#pragma unroll
    for (int n2 = 0; n2 < kN / 16; ++n2) {
      uint32_t b[4];
      load_b_kn(b, sB, b_stride, n2 * 16, ks * 16, lane);
      mma_16816<T>(acc[2 * n2], a, b[0], b[1]);
      mma_16816<T>(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// Store a 16-row fp32 strip (rows row0 + g, row0 + g + 8 < len) to a row-major global matrix.
template <typename T, int kN>
__device__ __forceinline__ void store_strip(T* gmem, int64_t row_stride, int row0, int len,
                                            const float (&acc)[kN / 8][4], float scale_lo,
                                            float scale_hi, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= len) continue;
    const float s = half ? scale_hi : scale_lo;
    T* dst = gmem + row * row_stride + 2 * t;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
      *reinterpret_cast<uint32_t*>(dst + nt * 8) =
          pack2<T>(acc[nt][2 * half] * s, acc[nt][2 * half + 1] * s);
  }
}

}  // namespace fastformer::cuda::attn
