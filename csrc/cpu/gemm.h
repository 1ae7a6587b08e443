// Register-blocked GEMM micro-kernel and a tile driver for the CPU kernels (attention tiles,
// FFN). Compiled per capability level; every type and constant here lives in that level's
// namespace.
//
// micro_kernel<A>: C[MR x NR] (+)= A[MR x K] * B[K x NR]
//   A element (i, k) at a[i * a_row + k * a_col]  (any strides: row-major A, or a transposed
//     view such as P^T with a_row = 1, a_col = ld), read one element at a time as broadcasts;
//   B element (k, j) at b[k * ldb + j]  (each row of NR values contiguous);
//   C element (i, j) at c[i * ldc + j].
// Per k: NV vector loads of B, MR broadcasts of A, MR * NV FMAs into MR * NV accumulator
// registers (AVX2 fp32: 6 x 2 ymm = 12 of 16 registers; AVX-512: 12 x 2 zmm = 24 of 32), so the
// loop is bound by FMA throughput: 2 * MR * NR flops per (NV + MR) loads.
//
// The kernel always computes a full MR x NR tile; it stores only the m <= MR valid rows and
// n <= NR valid columns. Callers make the MR-th row / NR-th column reads safe by giving A and B
// buffers slack (rows/columns padded with zeros), see kRowSlack.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {

// Rows of the micro-tile: as many as the vector register file holds with NV = 2.
template <typename A>
struct MicroShape {
#if defined(CPU_CAPABILITY_AVX512)
  static constexpr int kMR = 12;
#elif defined(CPU_CAPABILITY_AVX2)
  static constexpr int kMR = 6;
#else
  static constexpr int kMR = 4;
#endif
  static constexpr int kNV = 2;                                   // vectors per row
  static constexpr int kNR = kNV * Vectorized<A>::size();         // columns of the micro-tile
};

// Rows of the narrow micro-tile (micro_kernel's MR for GEMMs of at most this many rows): 4 rows
// x NV vectors is 8 accumulators, as many as two FMA ports with a 4-cycle latency keep busy.
constexpr int kNarrowMR = 4;

// Rows any A operand may be read beyond its last valid row (the micro-kernel reads MR rows).
constexpr int64_t kRowSlack = 16;

inline int64_t round_up_to(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// kARow / kACol, when not 0, are a_row / a_col known at compile time (the runtime values must
// equal them): A's MR row addresses are then constant offsets from one pointer. With a runtime
// row stride the AVX-512 kernel (MR = 12) keeps row addresses in general registers and spills
// them. MR: the rows of the micro-tile, MicroShape's by default; a GEMM of fewer rows (a decode
// step's G * Lq query rows) takes kNarrowMR instead of computing 12 rows for 1-4.
template <typename A, int64_t kARow = 0, int64_t kACol = 0, int MR = MicroShape<A>::kMR>
inline void micro_kernel(int64_t K, const A* __restrict a, int64_t a_row_arg, int64_t a_col_arg,
                         const A* __restrict b, int64_t ldb, A* __restrict c, int64_t ldc,
                         int64_t m, int64_t n, bool accumulate) {
  const int64_t a_row = kARow != 0 ? kARow : a_row_arg;
  const int64_t a_col = kACol != 0 ? kACol : a_col_arg;
  using V = Vectorized<A>;
  constexpr int NV = MicroShape<A>::kNV;
  constexpr int64_t kV = V::size();
  // Accumulating tiles (dK, dV blocks of 64 KB at D = 128, dQ rows) sit in L2: fetch their
  // lines now so the misses overlap the K loop instead of stalling the final loads.
  if (accumulate) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      __builtin_prefetch(c + i * ldc, 1, 3);
      __builtin_prefetch(c + i * ldc + NV * kV - 1, 1, 3);
    }
  }
  V acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V(A(0));

  // Unrolled 4x: the rolled loop ran at 143-175 GFLOP/s or 199 depending on K (192, 72, 128:
  // hot-L1 micro-benchmark, 2 threads; code alignment, the same build), unrolled at 191-200.
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const A* b_k = b + k * ldb;
    V b_vec[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b_vec[v] = V::loadu(b_k + v * kV);
    const A* a_k = a + k * a_col;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const V a_bcast(a_k[i * a_row]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(a_bcast, b_vec[v], acc[i][v]);
    }
  }

  // Stores with constant indices only (fully unrolled): a data-dependent index into acc would
  // make the compiler keep acc in memory and spill all of it every k (measured 3x slower).
  const bool full = m == MR && n == NV * kV;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int64_t cols = std::min<int64_t>(kV, n - v * kV);
      if (full || (i < m && cols == kV)) {
        A* dst = c + i * ldc + v * kV;
        (accumulate ? acc[i][v] + V::loadu(dst) : acc[i][v]).store(dst);
      } else if (i < m && cols > 0) {
        A* dst = c + i * ldc + v * kV;
        (accumulate ? acc[i][v] + V::loadu(dst, cols) : acc[i][v]).store(dst, cols);
      }
    }
  }
}

// Band structure of a tile (causality, a window), in tile-local indices: row i of C may use
// index t only when
//   kColsUpTo:  t = column of C,  i + lo_diag <= t <= i + diag   (S = Q K^T, dP = dO V^T: rows
//               are queries, columns keys)
//   kInnerUpTo: t = inner index,  i + lo_diag <= t <= i + diag   (O += P V, dQ += dS K: inner
//               index is the key)
//   kInnerFrom: t = inner index,  i - diag <= t <= i - lo_diag   (dV += P^T dO, dK += dS^T Q:
//               rows are keys, the inner index is the query)
// diag = kFar: no upper edge; lo_diag = -kFar: no lower edge (tile_gemm_amx reads the upper
// edge only). tile_gemm skips micro-tiles / inner ranges that only touch excluded pairs, at
// micro-tile granularity (MR rows, NR columns): callers must make the excluded entries of the
// A operand zero, and treat skipped C entries (kColsUpTo only: always excluded ones) as
// unwritten.
struct Band {
  enum Kind { kNone, kColsUpTo, kInnerUpTo, kInnerFrom };
  static constexpr int64_t kFar = int64_t{1} << 40;
  Kind kind = kNone;
  int64_t diag = kFar;
  int64_t lo_diag = -kFar;
};

// C[M x N] (+)= A[M x K] * B[K x N] by micro-tiles, B in NR-column panels:
//   B element (k, j) at b[(j / NR) * b_panel + k * ldb + j % NR].
// A row-major B is b_panel = NR, ldb = row length; a packed B (panel-major, every panel K x NR
// contiguous) is b_panel = K_total * NR, ldb = NR: the micro-kernel then streams each panel
// sequentially, which the prefetcher follows (row-major K^T blocks with 512-byte row strides
// measured 1.25x slower in the attention forward). Each B panel stays in L1 while the
// micro-kernel walks down A. A needs kRowSlack rows of readable slack past M (or M a multiple
// of MR); B needs full NR-wide panels. a_panel != 0: A is packed in MR-row panels, micro-row
// i starting at a + (i / MR) * a_panel (with a_row = 1, a_col = MR the MR values of one k are
// contiguous, see put_row_mr_panels in attention_common.h); 0: micro-row i at a + i * a_row.
template <typename A, int64_t kARow = 0, int64_t kACol = 0, int MR = MicroShape<A>::kMR>
inline void tile_gemm(int64_t M, int64_t N, int64_t K, const A* a, int64_t a_row, int64_t a_col,
                      const A* b, int64_t ldb, int64_t b_panel, A* c, int64_t ldc, bool accumulate,
                      Band band = {}, int64_t a_panel = 0) {
  constexpr int NR = MicroShape<A>::kNR;
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY((kARow == 0 || a_row == kARow) && (kACol == 0 || a_col == kACol));
  for (int64_t j = 0; j < N; j += NR) {
    const int64_t n = std::min<int64_t>(NR, N - j);
    const A* b_j = b + (j / NR) * b_panel;
    // kColsUpTo: rows above j - diag use none of the panel's columns, nor rows past
    // j + NR - 1 - lo_diag.
    const bool cols = band.kind == Band::kColsUpTo;
    const int64_t i_begin = cols ? std::max<int64_t>(0, j - band.diag) / MR * MR : 0;
    const int64_t i_end = cols ? std::min<int64_t>(M, j + NR - band.lo_diag) : M;
    for (int64_t i = i_begin; i < i_end; i += MR) {
      int64_t k_lo = 0, k_hi = K;
      if (band.kind == Band::kInnerUpTo) {
        k_lo = std::clamp<int64_t>(i + band.lo_diag, 0, K);
        k_hi = std::clamp<int64_t>(i + MR + band.diag, 0, K);
      } else if (band.kind == Band::kInnerFrom) {
        k_lo = std::clamp<int64_t>(i - band.diag, 0, K);
        k_hi = std::clamp<int64_t>(i + MR - band.lo_diag, 0, K);
      }
      k_hi = std::max(k_hi, k_lo);  // no inner index: C = 0, or C unchanged when accumulating
      const A* a_i = a_panel ? a + (i / MR) * a_panel : a + i * a_row;
      micro_kernel<A, kARow, kACol, MR>(k_hi - k_lo, a_i + k_lo * a_col, a_row, a_col, b_j + k_lo * ldb, ldb,
                      c + i * ldc + j, ldc, std::min<int64_t>(MR, M - i), n, accumulate);
    }
  }
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
