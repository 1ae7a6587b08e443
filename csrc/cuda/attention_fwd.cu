// Flash attention forward, fp16/bf16 on tensor cores (mma.sync m16n8k16, sm_80 and newer), head
// dims 64 and 128 (template parameter D).
//
// Algorithm (FlashAttention-2): one block per (128-row query block, head, batch); 8 warps, each
// owning a 16-row strip of queries. Q goes global -> smem (cp.async) -> registers (ldmatrix)
// once; K and V stream through smem in 64-key blocks j:
//   S  = x(Q K_j^T) (ScoreMap, attention_common.cuh: s scale log2(e), or with softcap c
//        c log2(e) tanh(s scale / c)), -inf where the key is padding, out of range (both
//        through a per-block smem row of 0/-inf) or outside the band causality and the window
//        leave (lo <= j - i <= hi, Band)
//   m' = max(m, rowmax S)   alpha = exp2(m - m')   P = exp2(S - m')   l' = alpha l + rowsum P
//   O' = alpha O + P V_j    (P rounded to T and re-packed from the S accumulators: no smem)
// and at the end out = O / l, lse = m ln2 + log l, both from common/online_softmax.h (rows with
// no allowed key: out 0, lse +inf). Band: only the key blocks that hold a key some row of the
// query block may see are visited ([i0 + lo, i1 + hi], Band::keys_of_rows: causal skips the
// blocks above the diagonal, a window those left of it too), and the element mask is evaluated
// only in the warp tiles an edge of the band cuts. GQA: head h reads kv head h / (H / Hkv).
// Pipeline: V_j's copy overlaps S = Q K_j^T, K_{j+1}'s copy overlaps P V_j.
//
// Memory traffic per block: Q and out once (128 x D each), K and V once per visited key block
// (read from L2 by every query block: 128 rows of reuse per 64 x D x 2 x 2 B tile loaded). With
// a window (left, right) the keys of a query block span 128 + left + right positions, so it
// visits at most 2 + (128 + left + right) / 64 key blocks: K/V traffic and work grow with
// Lq (left + right), not Lq Lk. Softcap adds no traffic (two more MUFU operations per score,
// common/softcap.h).
// Budget per 256-thread block (nvcc 13.0 -Xptxas -v, fp16 = bf16; 0 bytes spilled everywhere):
//   D = 64:  smem (128 + 2 x 64) rows x 72 x 2 B + 64 x 4 B = 37,120 B;  registers 151 (sm_80),
//            153 (sm_90)
//   D = 128: smem (128 + 2 x 64) rows x 136 x 2 B + 64 x 4 B = 69,888 B; registers 211 (sm_80),
//            219 (sm_90)
// so one block (8 warps) per SM, bound by registers: capping them at 128 for two blocks
// (__launch_bounds__(256, 2)) spills at D = 64. Both fit the 99 KB per-block smem of sm_86/89.
#include "common/online_softmax.h"
#include "cuda/attention_common.cuh"

namespace fastformer::cuda {
namespace {
using namespace attn;

template <int D>
struct FwdTile {
  static constexpr int kWarps = 8, kThreads = kWarps * kWarpSize;
  static constexpr int kBlockM = 16 * kWarps;  // query rows per block
  static constexpr int kBlockN = 64;           // keys per step
  static constexpr int kStride = padded_stride(D);
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kStride * 2 + kBlockN * 4;
  static_assert(kSmemBytes <= 99 * 1024, "sm_86/sm_89 allow 99 KB of shared memory per block");
};

template <typename T, int D>
__global__ void __launch_bounds__(FwdTile<D>::kThreads, 1)
    attention_fwd_kernel(const AttentionFwdParams p) {
  using Tile = FwdTile<D>;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kBlockM * kStride;
  T* sV = sK + kBlockN * kStride;
  float* sKeyBias = reinterpret_cast<float*>(sV + kBlockN * kStride);  // 0 or -inf per key

  const AttentionShape& s = p.shape;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;  // longest (causal) blocks start first
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (s.heads / s.kv_heads);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // this lane holds rows g, g + 8 and columns 2t, 2t + 1
  const int row0 = m0 + warp * 16;       // first query row of this warp's strip

  const T* k = head_ptr<T>(p.k, b, h_kv);
  const T* v = head_ptr<T>(p.v, b, h_kv);
  const Band band = key_band(s);
  const ScoreMap score(s);
  // key blocks [n_first, n_stop) hold every key some row of this block may see
  const Range keys = band.keys_of_rows(m0, min(m0 + kBlockM, s.len_q) - 1, s.len_k);
  const int n_first = keys.first / kBlockN;
  const int n_stop = keys.end > keys.first ? (keys.end + kBlockN - 1) / kBlockN : n_first;

  auto load_k = [&](int n0) {
    load_tile_async<kBlockN, D, kThreads>(sK, k, p.k.row, n0, s.len_k);
    if (threadIdx.x < kBlockN)
      sKeyBias[threadIdx.x] = key_allowed(s, b, n0 + threadIdx.x) ? 0.f : -INFINITY;
  };
  load_tile_async<kBlockM, D, kThreads>(sQ, head_ptr<T>(p.q, b, h), p.q.row, m0, s.len_q);
  if (n_first < n_stop) load_k(n_first * kBlockN);
  cp_async_commit();

  float o[D / 8][4] = {};  // unnormalized output strip, 16 x D
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8
  uint32_t q_frag[D / 16][4];

  for (int n_block = n_first; n_block < n_stop; ++n_block) {
    const int n0 = n_block * kBlockN;
    cp_async_wait_all();
    __syncthreads();  // K_j and its key bias (and Q) visible to every warp
    if (n_block == n_first) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        load_a(q_frag[ks], sQ + warp * 16 * kStride, kStride, ks * 16, lane);
    }
    load_tile_async<kBlockN, D, kThreads>(sV, v, p.v.row, n0, s.len_k);
    cp_async_commit();

    float sc[kBlockN / 8][4] = {};  // scores, then probabilities, 16 x kBlockN
    gemm_reg_a_bt<T, kBlockN, D>(sc, q_frag, sK, kStride, lane);

    // scaled (softcapped) scores, then the masks; the band's only where an edge cuts the tile
    const bool cut = band.cuts(row0, row0 + 15, n0, n0 + kBlockN - 1);
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * t + (e & 1);
        float tanh_unused;
        float x = score(sc[nt][e], tanh_unused) + sKeyBias[col];
        if (cut && !band.allows(row0 + g + 8 * (e >> 1), n0 + col)) x = -INFINITY;
        sc[nt][e] = x;
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8; a row's 4 lanes are a quad
      float mx = row_max[half];
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
        mx = fmaxf(mx, fmaxf(sc[nt][2 * half], sc[nt][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float alpha = online_softmax_alpha_log2(row_max[half], mx);
      const float shift = softmax_shift(mx);
      row_max[half] = mx;
      float sum = 0.f;  // this lane's part of the row sum: the quad is reduced once, at the end
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          sc[nt][e] = exp2f(sc[nt][e] - shift);
          sum += sc[nt][e];
        }
      }
      row_sum[half] = row_sum[half] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * half] *= alpha;
        o[dt][2 * half + 1] *= alpha;
      }
    }
    cp_async_wait_all();
    __syncthreads();  // V_j visible; every warp is done with K_j and its key bias
    if (n_block + 1 < n_stop) load_k(n0 + kBlockN);
    cp_async_commit();
    gemm_c_b<T, D, kBlockN>(o, sc, sV, kStride, lane);
  }
  cp_async_wait_all();  // nothing may be in flight at exit (blocks with no key block)

  float inv_sum[2], lse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv_sum[half] = softmax_inv_sum(l);
    lse[half] = softmax_lse_log2(row_max[half], l);
  }
  store_strip<T, D>(head_ptr<T>(p.out, b, h), p.out.row, row0, s.len_q, o, inv_sum[0], inv_sum[1],
                    lane);
  if (t == 0) {
    float* lse_row = p.lse + (static_cast<int64_t>(b) * s.heads + h) * s.len_q;
    if (row0 + g < s.len_q) lse_row[row0 + g] = lse[0];
    if (row0 + g + 8 < s.len_q) lse_row[row0 + g + 8] = lse[1];
  }
}

template <typename T, int D>
cudaError_t launch_fwd(const AttentionFwdParams& p, cudaStream_t stream) {
  using Tile = FwdTile<D>;
  const auto kernel = attention_fwd_kernel<T, D>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.shape.len_q + Tile::kBlockM - 1) / Tile::kBlockM, p.shape.heads,
                  p.shape.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool attention_supported(DType dtype, int head_dim) {
  return (dtype == DType::f16 || dtype == DType::bf16) && (head_dim == 64 || head_dim == 128);
}

cudaError_t attention_fwd(const AttentionFwdParams& p, cudaStream_t stream) {
  const AttentionShape& s = p.shape;
  if (!attention_supported(s.dtype, s.head_dim)) return cudaErrorInvalidValue;
  if (s.batch == 0 || s.heads == 0 || s.len_q == 0) return cudaSuccess;
  return attn::dispatch_attention(s.dtype, s.head_dim, [&](auto type_tag, auto dim_tag) {
    return launch_fwd<decltype(type_tag), decltype(dim_tag)::value>(p, stream);
  });
}

}  // namespace fastformer::cuda
