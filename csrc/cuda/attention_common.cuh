// Pieces shared by the flash-attention kernels (attention_fwd.cu, attention_bwd.cu): tile
// copies into shared memory, the per-warp tensor-core GEMMs on 16-row strips, and the masks.
//
// Shared-memory tiles are row-major with rows kHeadDim + 8 (or kCols + 8) elements apart: the
// 16 extra bytes move each row 4 banks along, so the 8 row addresses of one ldmatrix phase
// land in distinct bank groups (conflict-free) without an XOR swizzle.
#pragma once
#include <math.h>

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

// Causal: key j is allowed for query i iff j <= i + causal_offset.
__device__ __forceinline__ int causal_offset(const AttentionShape& s) {
  return s.causal == 2 ? s.len_k - s.len_q : 0;
}

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
