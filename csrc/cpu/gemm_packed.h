// Cache-blocked, multi-threaded GEMM on packed operands with a fused epilogue (BLIS-style),
// built on gemm.h's register micro-tile. Used by the FFN kernels (ffn.cpp); reusable by any
// kernel that needs C = op(A) op(B) followed by an elementwise step.
//
//   C[M x N] = A[M x K] * B[K x N], then epilogue(tile) on every MR x NR micro-tile of C.
//
// The caller never hands over matrices, only two packing callbacks, so an operand can come from
// any strides (a transposed weight needs no transposed copy), any element type (bf16/fp16 are
// converted while packing), or be computed on the fly (the FFN packs act(pre-activation) for
// its second GEMM instead of storing the post-activation):
//   pack_a(dst, i0, m, k0, kc): rows [i0, i0+m) x cols [k0, k0+kc) of A as ceil(m/MR) panels,
//       panel p = dst[p*kc*MR ...], element (i0 + p*MR + r, k0 + k) at [k*MR + r]; rows >= m zero.
//   pack_b(dst, k0, kc, j0, n): rows [k0, k0+kc) x cols [j0, j0+n) of B as ceil(n/NR) panels,
//       panel q = dst[q*kc*NR ...], element (k0 + k, j0 + q*NR + c) at [k*NR + c]; cols >= n zero.
//   epilogue(i0, j0, m, n, tile): C[i0 + r][j0 + c] = tile[r*NR + c] for r < m, c < n (the
//       tile is the full K sum, in the accumulation type, in L1); the callback stores it
//       wherever and however it wants (bias, activation, conversion, split outputs).
//
// Loops (per thread rectangle of C, see below), sizes for fp32 / AVX2 (MR = 6, NR = 16):
//   for jc in N step NC (2048)                       B block KC x NC: 2 MB, L3
//     for ig in M step MG (row group, ws budget)
//       for pc in K step KC (256)
//         pack B block (pc, jc)
//         for ic in group step MC (96)              A block MC x KC: 96 KB, L2
//           pack A block (ic, pc)
//           for jr in NC step NR: for ir in MC step MR   B micro-panel KC x NR: 16 KB, L1
//             acc = A panel * B panel (+ partial sum of earlier K blocks from the workspace)
//             last K block ? epilogue(acc) : workspace = acc
// Partial sums over K blocks live in a per-thread fp32 (fp64) workspace of MG x NC (<= 16 MB),
// never in C's own storage, so C may be bf16, split over several tensors, or have no storage.
// The workspace is stored tile by tile (each MR x NR partial sum 384 contiguous bytes, the
// tiles of one B micro-panel consecutive), not as an MG x NC matrix: a row-major tile's 6 rows
// lay 8 KB apart, 6 pages per micro-kernel call, and the fused SwiGLU forward+backward at
// (2048, 4096, 11008) ran 1.07x slower with it (side by side, 2 threads). Its 16 MB hold 2048
// rows of a 2048-column block, so at 2048 tokens B is packed once per thread; with 8 MB it is
// packed twice (1.04x slower).
// Traffic: B is packed ceil(M_rect / MG) times, A ceil(N_rect / NC) times (each a few percent
// of the flops at the FFN's shapes); C is written once, by the epilogue.
//
// Threads: C is cut into one rectangle per thread (rm row chunks x cn column chunks, at MR/NR
// granularity); each thread packs what its rectangle needs into its own buffers, so there is no
// barrier and one at::parallel_for per GEMM. Splitting N makes every thread pack all of A,
// splitting M all of B: the split is chosen from the callers' per-element packing costs (an
// operand computed with an activation costs ~5x a plain one). Below ~4 MFLOP one thread runs it.
//
// Measured on the 2-core Zen 3 (AVX2) of benchmarks/RESULTS.md, fp32, (4096 x 3072) =
// (4096 x 768) x (768 x 3072), 2 threads: see the numbers in ffn.cpp's header.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/gemm.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {

template <typename A>
struct PackedBlocking {
  static constexpr int64_t kMR = MicroShape<A>::kMR;
  static constexpr int64_t kNR = MicroShape<A>::kNR;
  static constexpr int64_t kKC = 256;   // B micro-panel KC x NR = 16 KB (fp32 and fp64): L1
  static constexpr int64_t kMC = 96;    // A block 96 x 256 fp32 = 96 KB: L2 (a multiple of MR)
  static constexpr int64_t kNC = 2048;  // B block 2 MB fp32 per thread: L3
  static constexpr int64_t kWorkspaceBytes = 16 << 20;  // K-partial sums per thread (see above)
  static_assert(kMC % kMR == 0, "MC must be a multiple of MR");
};

// acc = A panel (kc x MR, packed) * B panel (kc x NR, packed) (+ c_in), written as a full
// MR x NR tile to out (row stride ld_out). c_in: a full tile (row stride ld_in) or null.
template <typename A>
inline void packed_micro_kernel(int64_t kc, const A* __restrict a, const A* __restrict b,
                                const A* c_in, int64_t ld_in, A* out, int64_t ld_out) {
  using V = Vectorized<A>;
  constexpr int MR = MicroShape<A>::kMR;
  constexpr int NV = MicroShape<A>::kNV;
  constexpr int64_t kV = V::size();
  // The partial-sum tile (c_in) and the destination live in a workspace far bigger than L2:
  // fetch their lines now so the misses overlap the kc FMA steps instead of stalling the
  // final loads and stores (measured +10-25% at K = 768 on Zen 3, one thread).
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (c_in != nullptr) __builtin_prefetch(c_in + i * ld_in, 0, 3);
    if (out != c_in) __builtin_prefetch(out + i * ld_out, 1, 3);
  }
  V acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V(A(0));
#pragma GCC unroll 4  // measured +6-12% in the 2-thread GEMM (loop overhead, scheduling)
  for (int64_t k = 0; k < kc; ++k) {
    V b_vec[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b_vec[v] = V::loadu(b + v * kV);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const V a_bcast(a[i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(a_bcast, b_vec[v], acc[i][v]);
    }
    a += MR;
    b += NV * kV;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      V r = acc[i][v];
      if (c_in != nullptr) r = r + V::loadu(c_in + i * ld_in + v * kV);
      r.store(out + i * ld_out + v * kV);
    }
  }
}

namespace packed_detail {

// Work of one thread: rows [m0, m1) x columns [n0, n1) of C.
template <typename A, typename PackA, typename PackB, typename Epi>
void gemm_rect(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const PackA& pack_a,
               const PackB& pack_b, const Epi& epilogue) {
  using Blk = PackedBlocking<A>;
  constexpr int64_t MR = Blk::kMR, NR = Blk::kNR, KC = Blk::kKC, MC = Blk::kMC;
  const int64_t nc_max = std::min<int64_t>(Blk::kNC, round_up_to(n1 - n0, NR));
  const int64_t mg_budget = Blk::kWorkspaceBytes / static_cast<int64_t>(sizeof(A)) / nc_max;
  const int64_t rows_all = round_up_to(m1 - m0, MC);
  const int64_t mg_max = K > KC ? std::clamp<int64_t>(mg_budget / MC * MC, MC, rows_all) : rows_all;
  A* const a_pack = thread_scratch<A, Scratch::kGemmAPack>(MC * KC);
  A* const b_pack = thread_scratch<A, Scratch::kGemmBPack>(KC * nc_max);
  A* const ws = K > KC ? thread_scratch<A, Scratch::kGemmWorkspace>(mg_max * nc_max) : nullptr;
  alignas(64) A tile[MR * NR];
  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    for (int64_t ig = m0; ig < m1; ig += mg_max) {
      const int64_t mg = std::min(mg_max, m1 - ig);
      for (int64_t pc = 0; pc < K; pc += KC) {
        const int64_t kc = std::min(KC, K - pc);
        const bool first = pc == 0, last = pc + kc == K;
        pack_b(b_pack, pc, kc, jc, nc);
        for (int64_t ic = ig; ic < ig + mg; ic += MC) {
          const int64_t mc = std::min(MC, ig + mg - ic);
          pack_a(a_pack, ic, mc, pc, kc);
          for (int64_t jr = 0; jr < nc; jr += NR) {
            const A* b_panel = b_pack + (jr / NR) * kc * NR;
            for (int64_t ir = 0; ir < mc; ir += MR) {
              const A* a_panel = a_pack + (ir / MR) * kc * MR;
              // Partial sums tile by tile: micro-tile (ir, jr) is MR x NR contiguous values.
              A* ws_tile = ws != nullptr ? ws + ((jr / NR) * (mg_max / MR) + (ic - ig + ir) / MR) * (MR * NR) : nullptr;
              const A* partial = first ? nullptr : ws_tile;
              if (last) {
                packed_micro_kernel<A>(kc, a_panel, b_panel, partial, NR, tile, NR);
                epilogue(ic + ir, jc + jr, std::min(MR, mc - ir), std::min(NR, nc - jr), tile);
              } else {
                packed_micro_kernel<A>(kc, a_panel, b_panel, partial, NR, ws_tile, NR);
              }
            }
          }
        }
      }
    }
  }
}

// Rows and columns of the per-thread rectangles: the (rm, cn) with rm * cn <= threads whose
// slowest thread has the least work, counting compute and the duplicated packing.
struct Split {
  int64_t rm = 1, cn = 1, rows = 0, cols = 0;
};

template <typename A>
Split choose_split(int64_t M, int64_t N, int64_t K, int64_t threads, double a_cost, double b_cost) {
  using Blk = PackedBlocking<A>;
  Split best;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int64_t cn = 1; cn <= threads; ++cn) {
    const int64_t rm = threads / cn;
    const int64_t cols = round_up_to((N + cn - 1) / cn, Blk::kNR);
    const int64_t rows = round_up_to((M + rm - 1) / rm, Blk::kMR);
    const double a_passes = static_cast<double>((cols + Blk::kNC - 1) / Blk::kNC);
    const double mg = std::max<double>(Blk::kMC, Blk::kWorkspaceBytes / sizeof(A) /
                                                     static_cast<double>(std::min(cols, Blk::kNC)));
    const double b_passes = K > Blk::kKC ? std::ceil(rows / mg) : 1.0;
    const double cost = 2.0 * rows * cols * K + a_cost * rows * K * a_passes +
                        b_cost * cols * K * b_passes;
    if (cost < best_cost * 0.999) {
      best_cost = cost;
      best = Split{rm, cn, rows, cols};
    }
  }
  return best;
}

}  // namespace packed_detail

// C = A * B with the packing callbacks and epilogue described above. a_cost, b_cost: relative
// cost of packing one element of A, B (in flops; ~8 for a plain or converted copy).
template <typename A, typename PackA, typename PackB, typename Epi>
void gemm_packed(int64_t M, int64_t N, int64_t K, double a_cost, double b_cost,
                 const PackA& pack_a, const PackB& pack_b, const Epi& epilogue) {
  using Blk = PackedBlocking<A>;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sum: every tile is zero
    alignas(64) A zero[Blk::kMR * Blk::kNR] = {};
    for (int64_t i = 0; i < M; i += Blk::kMR)
      for (int64_t j = 0; j < N; j += Blk::kNR)
        epilogue(i, j, std::min(Blk::kMR, M - i), std::min(Blk::kNR, N - j), zero);
    return;
  }
  const double flops = 2.0 * M * N * K;
  const int64_t threads = flops < 4e6 ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const packed_detail::Split s = packed_detail::choose_split<A>(M, N, K, threads, a_cost, b_cost);
  auto rect = [&](int64_t t) {
    const int64_t r = t / s.cn, c = t % s.cn;
    const int64_t m0 = r * s.rows, n0 = c * s.cols;
    const int64_t m1 = std::min(M, m0 + s.rows), n1 = std::min(N, n0 + s.cols);
    if (m0 < m1 && n0 < n1) packed_detail::gemm_rect<A>(m0, m1, n0, n1, K, pack_a, pack_b, epilogue);
  };
  if (s.rm * s.cn == 1) {
    rect(0);
    return;
  }
  at::parallel_for(0, s.rm * s.cn, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rect(t);
  });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
