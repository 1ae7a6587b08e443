// y = x W^T (+ b) for a few rows of x (decoding: one token per sequence, or the few tokens of a
// speculative step), W (O, I) in the weights' dtype, y in fp32.
//
// The cost is reading W once: O x I elements streamed from memory (a Llama layer's weights are
// far beyond the caches), against rows x I x O multiply-adds. Tasks over blocks of W's rows
// (at::parallel_for, each thread streams its own contiguous block). Three forms:
//  * f32 weights with 1-2 rows, bf16 / f16 weights with 1-8 (no AMX, or I not a multiple of
//    32), x in fp32 rows: dot products along I, WB = max(1, 8 / rows) weight rows walked
//    together so that 8 independent FMA chains hide the FMA latency, each x row read from L1,
//    one horizontal sum per output.
//  * f32 weights, 3 or more rows: x transposed, weight scalars broadcast against vectors of
//    rows (below). The dot form reloads every x row per weight vector (x no longer fits L1: 8
//    rows of 4096 fp32 are 128 KiB) and ran 14.6 GB/s at 8 rows on the 2-core AMX Xeon against
//    24-27 for this form up to 16 rows; 3 rows 24.9 vs 23.2 GB/s, 2 rows 25.0 vs 27.1.
//  * bf16 weights on AMX (I a multiple of 32): the weight rows read in place as A tiles
//    (below): 26-27 GB/s for 1-16 rows where oneDNN's bf16 GEMM reads 20-22 (1.2-1.3x up to 64
//    rows; ops/linear.py has the measurements).
//  * bf16 weights on AVX512-BF16 without AMX (I a multiple of 32): VDPBF16PS on bf16 pairs,
//    the dot form for 1-4 rows, 5 and more as bf16_gemm.h's dot blocks over pair panels of x
//    (below): 1.1-1.7x oneDNN's GEMM for 1-64 rows on a 2-core Zen 4.
//  * weights stored in-major, (I, O) rows (W^T as it lies: GPT-2's Conv1D, gpt-oss's and Llama
//    4's stacked experts read through a transposed view), any dtype, 1-8 rows: y += x[:, i] W^T[i]
//    row after row of W^T (below).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu/bf16_gemm.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kWeightBytesPerTask = 256 * 1024;  // parallel grain, in bytes of W

// Output rows [o, o + NW): NW weight rows against the R rows of x, NW x R accumulators.
template <typename T, int R, int NW>
inline void weight_rows(const LinearRowsArgs& a, int64_t o) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  const int64_t I = a.in_features, O = a.out_features, full = I / kV * kV;
  const T* W = static_cast<const T*>(a.weight) + o * a.ld_weight;
  V acc[NW][R];
  for (int w = 0; w < NW; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = V(0.0f);
  for (int64_t i = 0; i < full; i += kV) {
    V xv[R];
    for (int r = 0; r < R; ++r) xv[r] = V::loadu(a.x + r * I + i);
    for (int w = 0; w < NW; ++w) {
      const V wv = load_acc(W + w * a.ld_weight + i);
      for (int r = 0; r < R; ++r) acc[w][r] = at::vec::fmadd(wv, xv[r], acc[w][r]);
    }
  }
  for (int w = 0; w < NW; ++w) {
    const T* wrow = W + w * a.ld_weight;
    for (int r = 0; r < R; ++r) {
      float s = reduce_add(acc[w][r]);
      for (int64_t i = full; i < I; ++i) s += static_cast<float>(wrow[i]) * a.x[r * I + i];
      const float b = a.bias ? static_cast<float>(static_cast<const T*>(a.bias)[o + w]) : 0.0f;
      a.y[r * O + o + w] = s + b;
    }
  }
}

template <typename T, int R>
void linear_rows_typed(const LinearRowsArgs& a) {
  constexpr int WB = R >= 8 ? 1 : 8 / R;  // weight rows per step
  const int64_t I = a.in_features, O = a.out_features;
  const int64_t grain = std::max<int64_t>(
      WB, kWeightBytesPerTask / std::max<int64_t>(1, I * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, O, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + WB <= end; o += WB) weight_rows<T, R, WB>(a, o);
    for (; o < end; ++o) weight_rows<T, R, 1>(a, o);
  });
}

template <typename T>
void linear_rows_dispatch(const LinearRowsArgs& a) {
  switch (a.rows) {
    case 1: return linear_rows_typed<T, 1>(a);
    case 2: return linear_rows_typed<T, 2>(a);
    case 3: return linear_rows_typed<T, 3>(a);
    case 4: return linear_rows_typed<T, 4>(a);
    case 5: return linear_rows_typed<T, 5>(a);
    case 6: return linear_rows_typed<T, 6>(a);
    case 7: return linear_rows_typed<T, 7>(a);
    default: return linear_rows_typed<T, 8>(a);
  }
}

// ---- more rows: x transposed, one weight scalar broadcast against a vector of rows -----------
// y^T = W x^T as a GEMM whose A is W (row-major, read as it lies) and whose B is x^T (in,
// ld_x_t) packed by the binding with the rows zero-padded to a multiple of 16. For each k, MV
// vectors of x^T's row k (MV * kV token rows, from L1/L2: x^T is in x ld_x_t floats) meet MR
// weight scalars W[o + j][k], each broadcast: MR x MV accumulators, MR + MV loads per MR x MV
// FMAs, no horizontal sums. The weights stream once from memory in MR concurrent row streams,
// each prefetched 128 elements (8 lines) ahead: without it the 4-byte steps through each line
// kept too few misses in flight (21.5 -> 24.6 GB/s at 16 rows; 64 or 256 ahead: 23.0, 22.6).
// Rows beyond one chunk of kChunkVectors re-read the MR-row block from L2 (o-block outer).
template <int MV>
constexpr int block_weight_rows() {  // MR: MR x MV accumulators + MV x vectors (+ 1 broadcast
  // register under AVX2, which has no broadcast memory operand) within 32 zmm / 16 ymm
  return Vectorized<float>::size() == 16 ? std::min(10, 24 / MV) : std::min(12, (15 - MV) / MV);
}
// Vectors of rows per chunk: 4 zmm (64 rows), 2 ymm (16 rows; 4 left 2 weight rows per block)
constexpr int64_t kChunkVectors = Vectorized<float>::size() == 16 ? 4 : 2;

constexpr int64_t kSumRun = 128;  // values of k per partial sum (a multiple of 16)

template <int MV, int MR>
inline void weight_block_t(const LinearRowsArgs& a, int64_t o, int64_t col) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  const int64_t I = a.in_features, O = a.out_features, ld = a.ld_weight;
  const float* W = static_cast<const float*>(a.weight) + o * ld;
  const float* xt = a.x_t + col;
  V acc[MR][MV];
  for (int j = 0; j < MR; ++j)
    for (int v = 0; v < MV; ++v) acc[j][v] = V(0.0f);
  const auto step = [&](int64_t k) {
    V xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = V::loadu(xt + k * a.ld_x_t + v * kV);
    for (int j = 0; j < MR; ++j) {
      const V wv(W[j * ld + k]);
      for (int v = 0; v < MV; ++v) acc[j][v] = at::vec::fmadd(wv, xv[v], acc[j][v]);
    }
  };
  // Each lane sums its output over all of I: in runs of kSumRun values of k whose sums are added
  // to `total` (L1), as a blocked GEMM's K loop does; one chain over I = 512-2048 had twice
  // MKL's rounding error, which an ill-conditioned model (EmbeddingGemma at random weights)
  // amplified to 2.3x eager fp32's error against fp64.
  alignas(64) float total[MR][MV * kV] = {};
  int64_t k = 0;
  while (k < I) {
    const int64_t run_end = std::min(I, k + kSumRun);
    for (; k + 16 <= run_end; k += 16) {
      for (int j = 0; j < MR; ++j) __builtin_prefetch(W + j * ld + k + 128, 0, 3);
      for (int kk = 0; kk < 16; ++kk) step(k + kk);
    }
    for (; k < run_end; ++k) step(k);
    for (int j = 0; j < MR; ++j)
      for (int v = 0; v < MV; ++v) {
        (V::loadu(total[j] + v * kV) + acc[j][v]).store(total[j] + v * kV);
        acc[j][v] = V(0.0f);
      }
  }
  const int64_t valid = std::min<int64_t>(MV * kV, a.rows - col);
  for (int j = 0; j < MR; ++j) {
    const float b = a.bias ? static_cast<const float*>(a.bias)[o + j] : 0.0f;
    for (int64_t r = 0; r < valid; ++r) a.y[(col + r) * O + o + j] = total[j][r] + b;
  }
}

// Output rows [o, o + MR) for every row of x: chunks of up to four vectors of rows (MR is the
// widest chunk's block, so every chunk's accumulators fit).
template <int MR>
inline void weight_rows_t(const LinearRowsArgs& a, int64_t o) {
  constexpr int64_t kV = Vectorized<float>::size();
  constexpr int64_t kChunk = kChunkVectors * kV;
  for (int64_t col = 0; col < a.rows; col += kChunk) {
    switch ((std::min(kChunk, a.rows - col) + kV - 1) / kV) {
      case 1: weight_block_t<1, MR>(a, o, col); break;
      case 2: weight_block_t<2, MR>(a, o, col); break;
      case 3: if constexpr (kChunkVectors >= 3) weight_block_t<3, MR>(a, o, col); break;
      default: if constexpr (kChunkVectors >= 4) weight_block_t<4, MR>(a, o, col); break;
    }
  }
}

template <int MR>
void linear_rows_transposed_blocks(const LinearRowsArgs& a) {
  const int64_t grain = std::max<int64_t>(
      MR, kWeightBytesPerTask / std::max<int64_t>(1, a.in_features * 4) / MR * MR);
  at::parallel_for(0, a.out_features, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + MR <= end; o += MR) weight_rows_t<MR>(a, o);
    for (; o < end; ++o) weight_rows_t<1>(a, o);
  });
}

void linear_rows_transposed(const LinearRowsArgs& a) {
  constexpr int64_t kV = Vectorized<float>::size();
  switch (std::min<int64_t>(kChunkVectors, (a.rows + kV - 1) / kV)) {
    case 1: return linear_rows_transposed_blocks<block_weight_rows<1>()>(a);
    case 2: return linear_rows_transposed_blocks<block_weight_rows<2>()>(a);
    case 3: return linear_rows_transposed_blocks<block_weight_rows<3>()>(a);
    default: return linear_rows_transposed_blocks<block_weight_rows<kChunkVectors>()>(a);
  }
}


// ---- bf16 weights on AMX tiles: the weight rows read in place as A tiles ---------------------
// y^T = W x^T with A = 32 (or 16) rows of W straight from memory (tile rows of 64 bytes at the
// weight's row stride) and B = x^T as pair-word panels (bf16_gemm.h; packed once per call, rows
// of x zero-padded to a multiple of 16), C per 32 x 32 block in a local fp32 buffer, then
// y = C^T + b. No copy of W: oneDNN reorders the weight into its blocked layout on every call
// (what ff.convert's prepacked copies save), this form reads it as it lies. Rows beyond 32 run
// further column pairs with the same A tiles from L2. in_features must be a multiple of 32 (the
// binding checks); a last block of other than 16 or 32 rows comes from a zero-padded copy.
#ifdef FF_HAVE_BF16_GEMM
// x's rows as the B operand of bf16_gemm.h (pair-word panels of 16 rows, zero rows up to Mp)
struct XPanels {
  int64_t Mp, b_panel;
  std::vector<uint32_t> words;
  explicit XPanels(const LinearRowsArgs& a) : Mp(round_up_to(a.rows, 16)), b_panel(a.in_features / 2 * 16) {
    using bf16 = c10::BFloat16;
    const int64_t I = a.in_features, M = a.rows;
    const bf16* x = static_cast<const bf16*>(a.x_bf16);
    std::vector<bf16> x_pad;  // rows up to a multiple of 16, zeros past M (when M is not one)
    if (Mp != M) {
      x_pad.assign(Mp * I, bf16(0.0f));
      std::copy(x, x + M * I, x_pad.data());
      x = x_pad.data();
    }
    words.resize(Mp / 16 * b_panel);
    put_rows_pair_panels(x, I, Mp, I, words.data());
  }
};

void linear_rows_amx(const LinearRowsArgs& a) {
  using bf16 = c10::BFloat16;
  const int64_t I = a.in_features, O = a.out_features, M = a.rows;
  const XPanels x(a);
  const int64_t Mp = x.Mp, b_panel = x.b_panel;
  const std::vector<uint32_t>& panels = x.words;
  const bf16* W = static_cast<const bf16*>(a.weight);
  const int64_t grain = std::max<int64_t>(32, kWeightBytesPerTask / std::max<int64_t>(1, I * 2) / 32 * 32);
  at::parallel_for(0, (O + 31) / 32, std::max<int64_t>(1, grain / 32), [&](int64_t begin, int64_t end) {
    AmxTiles tiles(Bf16Gemm::kAmx);
    alignas(64) float c[32 * 64];
    std::vector<bf16> tail;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * 32, n = std::min<int64_t>(32, O - o);
      const bf16* w = W + o * a.ld_weight;
      int64_t ld = a.ld_weight;
      if (n < 32 && n % 16 != 0) {  // the last block: rows up to a multiple of 16, zeros past O
        tail.assign(round_up_to(n, 16) * I, bf16(0.0f));
        for (int64_t r = 0; r < n; ++r) std::copy(w + r * ld, w + r * ld + I, tail.data() + r * I);
        w = tail.data();
        ld = I;
      }
      for (int64_t j = 0; j < Mp; j += 32) {
        const uint32_t* b = panels.data() + (j / 16) * b_panel;
        const bool two_cols = j + 16 < Mp;
        if (n > 16) {
          if (two_cols) amx_block<2, 2>(I, w, ld, b, b_panel, c, 64, false);
          else amx_block<2, 1>(I, w, ld, b, b_panel, c, 64, false);
        } else {
          if (two_cols) amx_block<1, 2>(I, w, ld, b, b_panel, c, 64, false);
          else amx_block<1, 1>(I, w, ld, b, b_panel, c, 64, false);
        }
        const int64_t cols = std::min<int64_t>(32, M - j);
        for (int64_t i = 0; i < n; ++i) {
          const float bias = a.bias ? static_cast<float>(static_cast<const bf16*>(a.bias)[o + i]) : 0.0f;
          for (int64_t m = 0; m < cols; ++m) a.y[(j + m) * O + o + i] = c[i * 64 + m] + bias;
        }
      }
    }
  });
}

// ---- bf16 weights with AVX512-BF16 (no AMX): dot products of bf16 pairs ----------------------
// The dot form on bf16 operands: per 32 values of a weight row, one load and, for each of RC rows
// of x (bf16, from L1), one VDPBF16PS (16 lanes of two products each, fp32 sums), NW weight rows
// at a time (RC x NW <= 16 accumulators), one horizontal sum per output. No conversion of the
// weights (the fp32 dot form converted every weight vector, which made 2-64 rows 0.6-0.9x
// oneDNN's). Rows beyond 8 run in chunks of 8 against the same NW weight rows, read again from
// L1 / L2. in_features is a multiple of 32 (the binding checks).
// From this many rows, the panel form below. 2-core Zen 4, bf16 weights (11008 x 4096, 4096 x
// 11008, 4096 x 4096) x 3 in turn, medians of 7 against torch's oneDNN GEMM: this form 1-4 rows
// 1.72x / 1.42x / 1.31x / 1.28x (33-26 GB/s), 5-8 rows 1.01x / 0.95x / - / 0.92x; the panel form
// 1-4 rows 1.21x / 1.05x / 1.12x / 1.10x, 5 1.10x, 6 1.20x, 8 1.28x, 16 1.61x, 32 1.38x, 64 1.18x
// (425 GFLOP/s), 96 1.09x, 128 1.06x.
constexpr int64_t kDotPanelRows = 5;

template <int RC, int NW>
FF_DOT_TARGET inline void dot_rows(const LinearRowsArgs& a, int64_t r0, int64_t o) {
  const int64_t I = a.in_features, O = a.out_features, ld = a.ld_weight;
  const uint16_t* W = static_cast<const uint16_t*>(a.weight) + o * ld;
  const uint16_t* X = static_cast<const uint16_t*>(a.x_bf16) + r0 * I;
  __m512 acc[NW][RC];
#pragma GCC unroll 8
  for (int w = 0; w < NW; ++w)
#pragma GCC unroll 8
    for (int r = 0; r < RC; ++r) acc[w][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += 32) {
    __m512bh xv[RC];
#pragma GCC unroll 8
    for (int r = 0; r < RC; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(X + r * I + i);
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(W + w * ld + i);
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) acc[w][r] = _mm512_dpbf16_ps(acc[w][r], wv, xv[r]);
    }
  }
  for (int w = 0; w < NW; ++w) {
    const float b = a.bias ? static_cast<float>(static_cast<const c10::BFloat16*>(a.bias)[o + w]) : 0.0f;
    for (int r = 0; r < RC; ++r) a.y[(r0 + r) * O + o + w] = _mm512_reduce_add_ps(acc[w][r]) + b;
  }
}

template <int NW>
inline void dot_weight_rows(const LinearRowsArgs& a, int64_t o) {
  for (int64_t r0 = 0; r0 < a.rows; r0 += 8) {
    switch (std::min<int64_t>(8, a.rows - r0)) {
      case 1: dot_rows<1, NW>(a, r0, o); break;
      case 2: dot_rows<2, NW>(a, r0, o); break;
      case 3: dot_rows<3, NW>(a, r0, o); break;
      case 4: dot_rows<4, NW>(a, r0, o); break;
      case 5: if constexpr (NW <= 2) dot_rows<5, NW>(a, r0, o); break;
      case 6: if constexpr (NW <= 2) dot_rows<6, NW>(a, r0, o); break;
      case 7: if constexpr (NW <= 2) dot_rows<7, NW>(a, r0, o); break;
      default: if constexpr (NW <= 2) dot_rows<8, NW>(a, r0, o); break;
    }
  }
}

template <int NW>
void linear_rows_dot_blocks(const LinearRowsArgs& a) {
  const int64_t grain = std::max<int64_t>(NW, kWeightBytesPerTask / std::max<int64_t>(1, a.in_features * 2) / NW * NW);
  at::parallel_for(0, a.out_features, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + NW <= end; o += NW) dot_weight_rows<NW>(a, o);
    for (; o < end; ++o) dot_weight_rows<1>(a, o);
  });
}

// More rows: y^T = W x^T by bf16_gemm.h's dot_block, A = 8 rows of W read in place (each pair of
// values broadcast), B = x^T as pair-word panels (XPanels: from L1 / L2), 8 x 32 blocks of C: per
// pair of K values 8 broadcasts and two B loads feed 16 VDPBF16PS, where the form above issues
// one x load per VDPBF16PS from rows that outgrow L1 (8 rows of 4096 are 64 KiB).
void linear_rows_dot_panels(const LinearRowsArgs& a) {
  using bf16 = c10::BFloat16;
  const int64_t I = a.in_features, O = a.out_features, M = a.rows;
  const XPanels x(a);
  const bf16* W = static_cast<const bf16*>(a.weight);
  const int64_t grain = std::max<int64_t>(kDotRows, kWeightBytesPerTask / std::max<int64_t>(1, I * 2));
  at::parallel_for(0, (O + kDotRows - 1) / kDotRows, std::max<int64_t>(1, grain / kDotRows), [&](int64_t begin, int64_t end) {
    alignas(64) float c[kDotRows * 32];
    std::vector<bf16> tail;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * kDotRows, n = std::min<int64_t>(kDotRows, O - o);
      const bf16* w = W + o * a.ld_weight;
      int64_t ld = a.ld_weight;
      if (n < kDotRows) {  // the last block: zero rows past O
        tail.assign(kDotRows * I, bf16(0.0f));
        for (int64_t r = 0; r < n; ++r) std::copy(w + r * ld, w + r * ld + I, tail.data() + r * I);
        w = tail.data();
        ld = I;
      }
      for (int64_t j = 0; j < x.Mp; j += 32) {
        const uint32_t* b = x.words.data() + (j / 16) * x.b_panel;
        if (j + 16 < x.Mp) dot_block<2>(I, w, ld, b, x.b_panel, c, 32, false);
        else dot_block<1>(I, w, ld, b, x.b_panel, c, 32, false);
        const int64_t cols = std::min<int64_t>(32, M - j);
        for (int64_t i = 0; i < n; ++i) {
          const float bias = a.bias ? static_cast<float>(static_cast<const bf16*>(a.bias)[o + i]) : 0.0f;
          for (int64_t m = 0; m < cols; ++m) a.y[(j + m) * O + o + i] = c[i * 32 + m] + bias;
        }
      }
    }
  });
}

void linear_rows_dot(const LinearRowsArgs& a) {
  if (a.rows >= kDotPanelRows) return linear_rows_dot_panels(a);
  // NW weight rows per step: RC x NW <= 16 accumulators for the widest row chunk (RC <= 8)
  if (a.rows <= 2) return linear_rows_dot_blocks<8>(a);
  if (a.rows <= 4) return linear_rows_dot_blocks<4>(a);
  return linear_rows_dot_blocks<2>(a);
}
#else
void linear_rows_amx(const LinearRowsArgs&) { TORCH_INTERNAL_ASSERT(false, "linear_rows: AMX at a level without it"); }
void linear_rows_dot(const LinearRowsArgs&) { TORCH_INTERNAL_ASSERT(false, "linear_rows: AVX512-BF16 at a level without it"); }
#endif

// ---- weights stored in-major: (I, O) rows, W^T as it lies --------------------------------------
// y = x W^T as the sum over i of x[:, i] times row i of W^T. Each thread takes a contiguous block
// of W^T's rows (one contiguous stretch of memory, streamed in order) and accumulates its partial
// y (rows x O floats, L1/L2-resident) with U rows of W^T per pass: per vector of a row, U weight
// loads and, for each of the R rows of x, one accumulator load, U FMAs and one store (the x
// scalars broadcast once per pass, U * R <= 8 registers). The partials are summed at the end
// (threads x rows x O floats against I x O weights read).
template <typename T, int R, int U>
inline void in_major_pass(const LinearRowsArgs& a, int64_t i, float* acc) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  const int64_t I = a.in_features, O = a.out_features, full = O / kV * kV;
  const T* w[U];
  V xb[U][R];
  for (int u = 0; u < U; ++u) {
    w[u] = static_cast<const T*>(a.weight) + (i + u) * a.ld_weight;
    for (int r = 0; r < R; ++r) xb[u][r] = V(a.x[r * I + i + u]);
  }
  for (int64_t o = 0; o < full; o += kV) {
    V wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load_acc(w[u] + o);
    for (int r = 0; r < R; ++r) {
      V s = V::loadu(acc + r * O + o);
      for (int u = 0; u < U; ++u) s = at::vec::fmadd(wv[u], xb[u][r], s);
      s.store(acc + r * O + o);
    }
  }
  for (int64_t o = full; o < O; ++o)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r * O + o] += static_cast<float>(w[u][o]) * a.x[r * I + i + u];
}

// 3-8 rows: the pass above loads and stores each accumulator per U rows of W^T (U = 1-2 there),
// which bounded it at 10-20 GB/s. Instead a strip of NV vectors of columns keeps its R x NV
// accumulators in registers over kStripRows rows of W^T (those rows' lines streamed in parallel,
// each moving on by one strip per step), then adds them to the partial y.
constexpr int64_t kStripRows = 16;

template <typename T, int R, int NV>
inline void in_major_strip(const LinearRowsArgs& a, int64_t i0, int64_t i1, int64_t o, float* acc_out) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  const int64_t I = a.in_features, O = a.out_features;
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V(0.0f);
  for (int64_t i = i0; i < i1; ++i) {
    const T* w = static_cast<const T*>(a.weight) + i * a.ld_weight + o;
    V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_acc(w + v * kV);
    for (int r = 0; r < R; ++r) {
      const V xb(a.x[r * I + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(wv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      float* out = acc_out + r * O + o + v * kV;
      (V::loadu(out) + acc[r][v]).store(out);
    }
}

template <typename T, int R>
inline void in_major_strips(const LinearRowsArgs& a, int64_t i0, int64_t i1, float* acc) {
  using V = Vectorized<float>;
  constexpr int64_t kV = V::size();
  constexpr int NV = kV == 16 ? (R <= 4 ? 4 : 2) : (R <= 4 ? 2 : 1);  // R x NV + NV + 1 registers
  const int64_t O = a.out_features, full = O / kV * kV;
  for (int64_t ib = i0; ib < i1; ib += kStripRows) {
    const int64_t ie = std::min(i1, ib + kStripRows);
    int64_t o = 0;
    for (; o + NV * kV <= full; o += NV * kV) in_major_strip<T, R, NV>(a, ib, ie, o, acc);
    for (; o < full; o += kV) in_major_strip<T, R, 1>(a, ib, ie, o, acc);
    for (; o < O; ++o)
      for (int64_t i = ib; i < ie; ++i) {
        const float w = static_cast<float>(static_cast<const T*>(a.weight)[i * a.ld_weight + o]);
        for (int r = 0; r < R; ++r) acc[r * O + o] += w * a.x[r * a.in_features + i];
      }
  }
}

template <typename T, int R>
void linear_rows_in_major_typed(const LinearRowsArgs& a) {
  constexpr int U = R == 1 ? 8 : 4;
  const int64_t I = a.in_features, O = a.out_features;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), I / 64));
  const int64_t per_block = (I + blocks - 1) / blocks;
  std::vector<float> partial(blocks * R * O, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      float* acc = partial.data() + blk * R * O;
      const int64_t i1 = std::min(I, (blk + 1) * per_block);
      int64_t i = blk * per_block;
      if constexpr (R > 2) {
        in_major_strips<T, R>(a, i, i1, acc);
      } else {
        for (; i + U <= i1; i += U) in_major_pass<T, R, U>(a, i, acc);
        for (; i < i1; ++i) in_major_pass<T, R, 1>(a, i, acc);
      }
    }
  });
  at::parallel_for(0, O, 1024, [&](int64_t begin, int64_t end) {
    for (int r = 0; r < R; ++r)
      for (int64_t o = begin; o < end; ++o) {
        float s = a.bias ? static_cast<float>(static_cast<const T*>(a.bias)[o]) : 0.0f;
        for (int64_t blk = 0; blk < blocks; ++blk) s += partial[(blk * R + r) * O + o];
        a.y[r * O + o] = s;
      }
  });
}

template <typename T>
void linear_rows_in_major(const LinearRowsArgs& a) {
  switch (a.rows) {
    case 1: return linear_rows_in_major_typed<T, 1>(a);
    case 2: return linear_rows_in_major_typed<T, 2>(a);
    case 3: return linear_rows_in_major_typed<T, 3>(a);
    case 4: return linear_rows_in_major_typed<T, 4>(a);
    case 5: return linear_rows_in_major_typed<T, 5>(a);
    case 6: return linear_rows_in_major_typed<T, 6>(a);
    case 7: return linear_rows_in_major_typed<T, 7>(a);
    default: return linear_rows_in_major_typed<T, 8>(a);
  }
}

}  // namespace

void linear_rows(const LinearRowsArgs& args) {
  if (args.weight_in_major) {
    switch (args.dtype) {
      case DType::f32: return linear_rows_in_major<float>(args);
      case DType::bf16: return linear_rows_in_major<c10::BFloat16>(args);
      case DType::f16: return linear_rows_in_major<c10::Half>(args);
      default: return;
    }
  }
  if (args.x_bf16)  // bf16 weights on AMX, or on AVX512-BF16 without it
    return bf16_gemm() == Bf16Gemm::kAmx ? linear_rows_amx(args) : linear_rows_dot(args);
  if (args.x_t) return linear_rows_transposed(args);  // f32 weights, 3 or more rows
  switch (args.dtype) {
    case DType::f32: return linear_rows_dispatch<float>(args);
    case DType::bf16: return linear_rows_dispatch<c10::BFloat16>(args);
    case DType::f16: return linear_rows_dispatch<c10::Half>(args);
    default: return;  // the binding takes f32 / bf16 / f16 weights only
  }
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
