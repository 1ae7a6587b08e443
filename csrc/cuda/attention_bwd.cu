// Flash attention backward, fp16/bf16 on tensor cores (mma.sync m16n8k16, sm_80 and newer), head
// dims 64 and 128 (template parameter D). Math (reference/attention.py), per (b, h), with the
// forward's lse:
//   x = scale Q K^T, or with softcap c: x = c tanh(scale Q K^T / c)   (ScoreMap: as the forward)
//   P = exp(x - lse)      (0 where masked: padding, or outside the band of causality and the
//                          window; rows with lse = +inf give P = 0)
//   delta_i = sum_d dO_id O_id      dS = P * (dO V^T - delta) * scale  (* (1 - tanh^2), softcap)
//   dV = P^T dO    dK = dS^T Q    dQ = dS K          (dK, dV summed over the heads of a kv head)
//
// Three kernels:
//  1. delta: one warp per query row, delta = rowsum(dO * O) in fp32 (reads dO and O once).
//  2. main: one block per (64-key block, kv head, batch); 4 warps, each owning 16 keys, keeping
//     their dK and dV (16 x D fp32 each) in registers while looping over the query heads of the
//     kv head (GQA) and, for each, the query blocks of kBlockM rows that can see these keys
//     (Band::rows_of_keys: rows [j0 - hi, j1 - lo]; causal skips the blocks wholly above the
//     diagonal, a window those below its left edge too; the element mask is evaluated only in
//     the warp tiles an edge of the band cuts). Per query block, in registers: S^T = K Q^T and
//     dP^T = V dO^T (both GEMMs first, so that the elementwise pass has an element's score and
//     dP at once: the softcap's tanh serves P and dS there and is never stored), P^T, dS^T,
//     dV += P^T dO, dK += dS^T Q. dS^T goes to smem (rounded to T), then each warp computes a
//     16 x 64 piece of dQ = dS K and adds it to an fp32 (B, H, Lq, D) buffer with atomics
//     (red.global.add.f32): the dQ part skips the same query blocks. dK and dV are written
//     once, without atomics (0 for keys no query sees).
//  3. dq: dq = the fp32 buffer rounded to T, in dq's layout.
// dQ strategy: atomics rather than a second pass over the keys per query block, because that
// pass would recompute S and dP (2 of the 5 GEMMs again, +40% tensor-core work); the price is
// an fp32 workspace of B x H x Lq x D and run-to-run differences in dQ's last bits (the order
// of the fp32 additions varies). dK and dV are deterministic.
// Q/dO (and their lse, delta) are double-buffered in smem: query block i+1 is copied while i is
// computed.
//
// Memory traffic of the main kernel per block: K and V once; per visited query block Q, dO
// (kBlockM x D x 2 B each, from L2) and kBlockM x D fp32 atomics. With a window (left, right)
// a key block's rows span 64 + left + right positions, so it visits at most
// 2 + (64 + left + right) / kBlockM query blocks per query head: traffic and work grow with
// Lk (left + right), not Lq Lk. Softcap adds no traffic (two more MUFU operations per score).
// Budget per 128-thread block of the main kernel (nvcc 13.0 -Xptxas -v, fp16 = bf16; 0 bytes
// spilled everywhere):
//   D = 64  (kBlockM 64): smem 65,536 B; registers 254 (sm_80), 254 (sm_90)
//   D = 128 (kBlockM 32): smem 75,264 B; registers 254 (sm_80), 255 (sm_90)
// so two blocks (8 warps) per SM, bound by registers. ptxas takes what __launch_bounds__(128, 1)
// leaves it: capped at 240 (__maxnreg__) the kernel still compiles without spills everywhere,
// and at 232 it spills 16 bytes at D = 128 on one of sm_80 / sm_90, as the kernel did before
// it learnt the window and softcap (it took 228-248 registers then); capping at 170 for three
// blocks spills. kBlockM = 64 at D = 128 would need 115 KB of smem, over sm_86/89's 99 KB per
// block.
// The delta and dq kernels: 26 and 28 registers, no smem.
#include "common/online_softmax.h"
#include "cuda/attention_common.cuh"
#include "cuda/cuda_types.cuh"

namespace fastformer::cuda {
namespace {
using namespace attn;

template <int D>
struct BwdTile {
  static constexpr int kWarps = 4, kThreads = kWarps * kWarpSize;
  static constexpr int kBlockN = 16 * kWarps;        // keys per block
  static constexpr int kBlockM = D == 64 ? 64 : 32;  // queries per step
  static constexpr int kStride = padded_stride(D);
  static constexpr int kDsStride = padded_stride(kBlockM);
  static constexpr int kDqWarpsPerStrip = kWarps / (kBlockM / 16);  // warps per 16-row dQ strip
  static constexpr int kDqCols = D / kDqWarpsPerStrip;              // dQ columns per warp
  // sK, sV; sQ, sdO (two stages each); sdS; lse, delta (two stages each)
  static constexpr int kSmemBytes =
      (2 * kBlockN + 4 * kBlockM) * kStride * 2 + kBlockN * kDsStride * 2 + 4 * kBlockM * 4;
  static_assert(kSmemBytes <= 99 * 1024, "sm_86/sm_89 allow 99 KB of shared memory per block");
};

template <typename T, int D>
__global__ void __launch_bounds__(BwdTile<D>::kThreads, 1)
    attention_bwd_kernel(const AttentionBwdParams p) {
  using Tile = BwdTile<D>;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads, kDqCols = Tile::kDqCols;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;        // [2][kBlockM][kStride]
  T* sdO = sQ + 2 * kBlockM * kStride;   // [2][kBlockM][kStride]
  T* sdS = sdO + 2 * kBlockM * kStride;  // dS^T: [kBlockN][kDsStride]
  float* sLse =
      reinterpret_cast<float*>(sdS + kBlockN * Tile::kDsStride);  // [2][kBlockM], log2 units
  float* sDelta = sLse + 2 * kBlockM;                             // [2][kBlockM]

  const AttentionShape& s = p.shape;
  const int n0 = blockIdx.x * kBlockN, h_kv = blockIdx.y, b = blockIdx.z;
  const int group = s.heads / s.kv_heads;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // this lane holds rows g, g + 8 and columns 2t, 2t + 1
  const int key0 = n0 + warp * 16;       // first key of this warp's strip
  const bool key_ok[2] = {key_allowed(s, b, key0 + g), key_allowed(s, b, key0 + g + 8)};
  const Band band = key_band(s);
  const ScoreMap score(s);
  // query blocks [m_first, m_stop) hold every row that may see a key of this block
  const Range rows = band.rows_of_keys(n0, min(n0 + kBlockN, s.len_k) - 1, s.len_q);
  const int m_first = rows.first / kBlockM;
  const int m_stop = rows.end > rows.first ? (rows.end + kBlockM - 1) / kBlockM : m_first;
  const int blocks_per_head = m_stop - m_first;
  const int num_items = group * blocks_per_head;  // (query head, query block) pairs

  load_tile_async<kBlockN, D, kThreads>(sK, head_ptr<T>(p.k, b, h_kv), p.k.row, n0, s.len_k);
  load_tile_async<kBlockN, D, kThreads>(sV, head_ptr<T>(p.v, b, h_kv), p.v.row, n0, s.len_k);
  auto item_head = [&](int item) { return h_kv * group + item / blocks_per_head; };
  auto item_m0 = [&](int item) { return (m_first + item % blocks_per_head) * kBlockM; };
  auto load_item = [&](int item, int stage) {
    const int hq = item_head(item), m0 = item_m0(item);
    load_tile_async<kBlockM, D, kThreads>(sQ + stage * kBlockM * kStride, head_ptr<T>(p.q, b, hq),
                                          p.q.row, m0, s.len_q);
    load_tile_async<kBlockM, D, kThreads>(sdO + stage * kBlockM * kStride,
                                          head_ptr<T>(p.dout, b, hq), p.dout.row, m0, s.len_q);
    if (threadIdx.x < kBlockM) {
      const int row = m0 + threadIdx.x;
      const int64_t idx = (static_cast<int64_t>(b) * s.heads + hq) * s.len_q + row;
      sLse[stage * kBlockM + threadIdx.x] =
          row < s.len_q ? p.lse[idx] * static_cast<float>(kLog2e) : INFINITY;
      sDelta[stage * kBlockM + threadIdx.x] = row < s.len_q ? p.delta[idx] : 0.f;
    }
  };
  if (num_items > 0) load_item(0, 0);
  cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};  // this warp's 16 keys x D
  for (int item = 0; item < num_items; ++item) {
    const int stage = item & 1, hq = item_head(item), m0 = item_m0(item);
    cp_async_wait_all();
    __syncthreads();  // this item's tiles visible; every warp is done with the previous item
    if (item + 1 < num_items) load_item(item + 1, stage ^ 1);
    cp_async_commit();
    const T* sQ_i = sQ + stage * kBlockM * kStride;
    const T* sdO_i = sdO + stage * kBlockM * kStride;
    const float* lse_i = sLse + stage * kBlockM;
    const float* delta_i = sDelta + stage * kBlockM;

    // S^T = K Q^T and dP^T = V dO^T, 16 keys x kBlockM queries each; both GEMMs come first so
    // that the elementwise pass has the raw score and dP of an element at once (the softcap's
    // tanh is used twice there and never stored)
    float pt[kBlockM / 8][4] = {}, dst[kBlockM / 8][4] = {};
    gemm_smem_a_bt<T, kBlockM, D>(pt, sK + warp * 16 * kStride, kStride, sQ_i, kStride, lane);
    gemm_smem_a_bt<T, kBlockM, D>(dst, sV + warp * 16 * kStride, kStride, sdO_i, kStride, lane);
    // P^T = exp2(x - lse log2(e)) (x: ScoreMap), 0 where masked (the band's mask only where an
    // edge cuts the tile); dS^T = P^T (dP^T - delta) scale (* (1 - tanh^2) with softcap)
    const bool cut = band.cuts(m0, m0 + kBlockM - 1, key0, key0 + 15);
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * t + (e & 1);
        float th = 0.f;  // softcap: tanh(s scale / c)
        float prob = exp2f(score(pt[nt][e], th) - lse_i[col]);
        if (!key_ok[e >> 1] || (cut && !band.allows(m0 + col, key0 + g + 8 * (e >> 1))))
          prob = 0.f;
        float ds = prob * (dst[nt][e] - delta_i[col]) * s.scale;
        if (score.softcapped()) ds *= softcap_grad(th);
        pt[nt][e] = prob;
        dst[nt][e] = ds;
      }
    }
    gemm_c_b<T, D, kBlockM>(dv, pt, sdO_i, kStride, lane);   // dV += P^T dO
    gemm_c_b<T, D, kBlockM>(dk, dst, sQ_i, kStride, lane);  // dK += dS^T Q

    T* sdS_lane = sdS + (warp * 16 + g) * Tile::kDsStride + 2 * t;  // rows g, g + 8; cols 2t, +1
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<uint32_t*>(sdS_lane + 8 * half * Tile::kDsStride + nt * 8) =
            pack2<T>(dst[nt][2 * half], dst[nt][2 * half + 1]);
    }
    __syncthreads();  // dS^T of all kBlockN keys visible

    // dQ (16 queries x kDqCols columns of this warp) = dS K, added to the fp32 buffer
    const int strip = warp % (kBlockM / 16), col0 = warp / (kBlockM / 16) * kDqCols;
    float dq[kDqCols / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t a[4];
      load_a_trans(a, sdS + strip * 16, Tile::kDsStride, ks * 16, lane);
#pragma unroll
      for (int n2 = 0; n2 < kDqCols / 16; ++n2) {
        uint32_t bk[4];
        load_b_kn(bk, sK + col0, kStride, n2 * 16, ks * 16, lane);
        mma_16816<T>(dq[2 * n2], a, bk[0], bk[1]);
        mma_16816<T>(dq[2 * n2 + 1], a, bk[2], bk[3]);
      }
    }
    float* dq_head = p.dq_accum + (static_cast<int64_t>(b) * s.heads + hq) * s.len_q * D;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + strip * 16 + g + 8 * half;
      if (row >= s.len_q) continue;
      float* dst_row = dq_head + static_cast<int64_t>(row) * D + col0 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kDqCols / 8; ++nt) {
        atomicAdd(dst_row + nt * 8, dq[nt][2 * half]);
        atomicAdd(dst_row + nt * 8 + 1, dq[nt][2 * half + 1]);
      }
    }
  }
  cp_async_wait_all();  // nothing may be in flight at exit (blocks with no query block)
  store_strip<T, D>(head_ptr<T>(p.dk, b, h_kv), p.dk.row, key0, s.len_k, dk, 1.f, 1.f, lane);
  store_strip<T, D>(head_ptr<T>(p.dv, b, h_kv), p.dv.row, key0, s.len_k, dv, 1.f, 1.f, lane);
}

// Query row r of the flattened (B, H, Lq) -> (b, h, i).
struct RowIndex {
  int64_t b, h;
  int i;
};
__device__ __forceinline__ RowIndex split_row(const AttentionShape& s, int64_t r) {
  const int64_t bh = r / s.len_q;
  return {bh / s.heads, bh % s.heads, static_cast<int>(r % s.len_q)};
}

constexpr int kRowThreads = 256;

// delta[r] = sum_d dout[r, d] * out[r, d], one warp per query row.
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads)
    attention_bwd_delta_kernel(const AttentionBwdParams p) {
  const int64_t r =
      static_cast<int64_t>(blockIdx.x) * (kRowThreads / kWarpSize) + threadIdx.x / kWarpSize;
  if (r >= p.shape.batch * p.shape.heads * p.shape.len_q) return;
  const RowIndex at = split_row(p.shape, r);
  const T* o = head_ptr<T>(p.out, at.b, at.h) + at.i * p.out.row;
  const T* d_o = head_ptr<T>(p.dout, at.b, at.h) + at.i * p.dout.row;
  float acc = 0.f;
#pragma unroll
  for (int d = threadIdx.x % kWarpSize; d < D; d += kWarpSize)
    acc += to_float(o[d]) * to_float(d_o[d]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(kFullMask, acc, off);
  if (threadIdx.x % kWarpSize == 0) p.delta[r] = acc;
}

// dq[b, h, i, d] = dq_accum[b, h, i, d] rounded to T, two elements per thread.
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads) attention_bwd_dq_kernel(const AttentionBwdParams p) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  const int64_t r = pair / (D / 2);
  if (r >= p.shape.batch * p.shape.heads * p.shape.len_q) return;
  const int d = static_cast<int>(pair % (D / 2)) * 2;
  const RowIndex at = split_row(p.shape, r);
  const float* src = p.dq_accum + r * D + d;
  *reinterpret_cast<uint32_t*>(head_ptr<T>(p.dq, at.b, at.h) + at.i * p.dq.row + d) =
      pack2<T>(src[0], src[1]);
}

template <typename T, int D>
cudaError_t launch_bwd(const AttentionBwdParams& p, cudaStream_t stream) {
  using Tile = BwdTile<D>;
  const AttentionShape& s = p.shape;
  const int64_t rows = s.batch * s.heads * s.len_q;
  if (rows > 0) {
    cudaError_t err = cudaMemsetAsync(p.dq_accum, 0, sizeof(float) * rows * D, stream);
    if (err != cudaSuccess) return err;
    const int64_t blocks = (rows + kRowThreads / kWarpSize - 1) / (kRowThreads / kWarpSize);
    attention_bwd_delta_kernel<T, D><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(p);
  }
  if (s.len_k > 0) {
    const auto kernel = attention_bwd_kernel<T, D>;
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
    if (err != cudaSuccess) return err;
    const dim3 grid((s.len_k + Tile::kBlockN - 1) / Tile::kBlockN, s.kv_heads, s.batch);
    kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  }
  if (rows > 0) {
    const int64_t blocks = (rows * (D / 2) + kRowThreads - 1) / kRowThreads;
    attention_bwd_dq_kernel<T, D><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_bwd(const AttentionBwdParams& p, cudaStream_t stream) {
  const AttentionShape& s = p.shape;
  if (!attention_supported(s.dtype, s.head_dim)) return cudaErrorInvalidValue;
  if (s.batch == 0 || s.heads == 0) return cudaSuccess;
  return attn::dispatch_attention(s.dtype, s.head_dim, [&](auto type_tag, auto dim_tag) {
    return launch_bwd<decltype(type_tag), decltype(dim_tag)::value>(p, stream);
  });
}

}  // namespace fastformer::cuda
