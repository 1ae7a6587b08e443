// bf16 tile GEMMs for the attention GEMMs with bf16 inputs (attention_fwd.cpp, attention_bwd.cpp
// say which operands are rounded to bf16), and the layouts they read, at the AVX-512 level:
// AMX-BF16 tiles where the CPU has them, else AVX512-BF16 VDPBF16PS (bf16_gemm_mode(),
// cpu_kernels.h, decides once per kernel call); the other levels and dtypes use the fp32
// micro-kernel (gemm.h).
//
// C[M x N] (fp32) = A[M x K] B[K x N] with A and B in bf16. Both instructions multiply pairs of
// bf16 values and add both products to an fp32 lane (bf16 products are exact in fp32; sums
// rounded to nearest even; bf16 denormal inputs read as 0, fp32 denormal results flushed to 0),
// so the two kernels read the same operands:
//   A: bf16 rows, element (i, k) at a[i * lda + k]; K a multiple of 32 (zero padded), rows
//      readable (zeros) up to round_up(M, 16).
//   B: "pair words": elements (2p, j) and (2p + 1, j) as one 32-bit word, 16-column panels:
//      word (p, j) at b[(j / 16) * (K / 2) * 16 + p * 16 + j % 16]. For B = K^T of a row-major
//      K this is a 32-bit transpose of K's rows read as words (put_rows_pair_panels); for B = a
//      row-major matrix itself, its rows interleaved in pairs (put_row_pairs_panels).
//   C: element (i, j) at c[i * ldc + j], written (C = A B) or loaded and added to (C += A B);
//      rows up to round_up(M, 16) are stored (zero rows of A add nothing), N is a multiple of 16.
// AMX, per 32 x 32 block of C: four accumulator tiles (tmm0-3); per 32 values of K two A tiles
// and two B tiles (tmm4-7, 4 KB from L1/L2) feed four TDPBF16PS (32 K multiply-adds). One core,
// 128 x 192 x 64 with the C stores: 667 GFLOP/s, against ~200 for the fp32 micro-kernel.
// AVX512-BF16, per 8 x 32 block of C: 16 zmm accumulators; per pair of K values two pair-word
// vectors of B and 8 broadcast words of A feed 16 VDPBF16PS (two multiply-adds per lane each,
// twice the fp32 FMA's work per instruction). 2-core Zen 5, bf16 attention forward+backward at
// (8, 8, 512, 64): 29-30 ms against 44-45 on the fp32 micro-kernel over fp32 copies; causal
// (1, 16, 2048, 128): 101-119 against 166-172 (same process, alternating, best of 5).
//
// The tile registers are configured once per task (AmxTiles: LDTILECFG, then TILERELEASE so
// the thread does not carry 8 KB of tile state through context switches).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "cpu/cpu_kernels.h"
#include "cpu/gemm.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__) && defined(__GNUC__)
#define FF_HAVE_BF16_GEMM 1
#include <immintrin.h>
#define FF_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define FF_DOT_TARGET __attribute__((target("avx512bf16")))
#endif

namespace fastformer::cpu::CPU_CAPABILITY {

// The instructions of this call's bf16 attention GEMMs (asked once per kernel call): kFp32 means
// the fp32 micro-kernel on fp32 copies (every level without AVX-512, CPUs without AVX512-BF16).
inline Bf16Gemm bf16_gemm() {
#ifdef FF_HAVE_BF16_GEMM
  return bf16_gemm_mode();
#else
  return Bf16Gemm::kFp32;
#endif
}

constexpr int64_t kAmxK = 32;  // bf16 values of K per tile row (64 bytes)
constexpr int kDotRows = 8;    // rows of C per VDPBF16PS block

// K padded with zero columns to whole AMX tile rows (a multiple of kAmxK): the pair-word
// layouts both kernels read.
inline int64_t bf16_padded_k(int64_t k) { return round_up_to(k, kAmxK); }

// Copies a row of n bf16 values and zero-fills it to n_pad.
inline void put_bf16_row(const c10::BFloat16* src, int64_t n, int64_t n_pad, c10::BFloat16* dst) {
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + n_pad, c10::BFloat16(0.0f));
}

// Rows [0, n_rows) of bf16 `rows` (row stride ld; K values each, K a multiple of kAmxK; n_rows
// a multiple of 16) as the pair-word B operand of their transpose (see the header): 8 x 8
// transposes of 32-bit words (bit moves only, no arithmetic).
inline void put_rows_pair_panels(const c10::BFloat16* rows, int64_t ld, int64_t n_rows, int64_t K, uint32_t* dst) {
  const int64_t words = K / 2, ld_words = ld / 2;
  const float* src = reinterpret_cast<const float*>(rows);
  float* out = reinterpret_cast<float*>(dst);
  for (int64_t r0 = 0; r0 < n_rows; r0 += 8)
    for (int64_t w = 0; w < words; w += 8)
      transpose_8x8<float>(src + r0 * ld_words + w, ld_words, out + (r0 / 16) * words * 16 + w * 16 + r0 % 16, 16);
}

// Rows [0, n_rows) of a bf16 matrix (row i at row_of(i), n values of it, zeros past them up to
// n_cols, a multiple of 32; a null row_of(i) is a zero row; n_rows even) as the pair-word B
// operand of the matrix itself (K = its rows): word (p, j) holds elements (2p, j) and (2p + 1,
// j), in 16-column panels of n_rows / 2 words each (the header's layout). AVX-512: two
// 32-value row segments (masked loads past n) interleaved by two VPERMT2W.
template <class RowOf>
inline void put_row_pairs_panels_of(const RowOf& row_of, int64_t n_rows, int64_t n, int64_t n_cols, uint32_t* dst) {
  const int64_t pairs = n_rows / 2;
#if defined(CPU_CAPABILITY_AVX512)
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx_lo = _mm512_load_si512(kLo);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  const auto segment = [&](const c10::BFloat16* row, int64_t c) {
    if (!row || c >= n) return _mm512_setzero_si512();
    if (c + 32 <= n) return _mm512_loadu_si512(row + c);
    return _mm512_maskz_loadu_epi16((__mmask32{1} << (n - c)) - 1, row + c);
  };
  for (int64_t p = 0; p < pairs; ++p) {
    const c10::BFloat16 *even = row_of(2 * p), *odd = row_of(2 * p + 1);
    for (int64_t c = 0; c < n_cols; c += 32) {
      const __m512i e = segment(even, c), o = segment(odd, c);
      uint32_t* panel = dst + (c / 16) * pairs * 16 + p * 16;
      _mm512_storeu_si512(panel, _mm512_permutex2var_epi16(e, idx_lo, o));
      _mm512_storeu_si512(panel + pairs * 16, _mm512_permutex2var_epi16(e, idx_hi, o));
    }
  }
#else
  const auto value = [&](const c10::BFloat16* row, int64_t j) -> uint32_t {
    uint16_t bits = 0;
    if (row && j < n) std::memcpy(&bits, row + j, 2);
    return bits;
  };
  for (int64_t p = 0; p < pairs; ++p) {
    const c10::BFloat16 *even = row_of(2 * p), *odd = row_of(2 * p + 1);
    for (int64_t j = 0; j < n_cols; ++j)
      dst[(j / 16) * pairs * 16 + p * 16 + j % 16] = value(even, j) | value(odd, j) << 16;
  }
#endif
}

// put_row_pairs_panels_of for rows at a stride (row i at rows + i * ld, all n_cols values).
inline void put_row_pairs_panels(const c10::BFloat16* rows, int64_t ld, int64_t n_rows, int64_t n_cols, uint32_t* dst) {
  put_row_pairs_panels_of([&](int64_t i) { return rows + i * ld; }, n_rows, n_cols, n_cols, dst);
}

// The transpose of bf16 rows [0, n_rows) x [0, n_cols) (row stride ld; n_rows a multiple of 16,
// n_cols of 32) into n_cols rows of dst (row stride ld_dst, even): row pairs interleaved into
// words (put_row_pairs_panels, into `words`, n_rows * n_cols / 2 of them), then 8 x 8 word
// transposes: word (p, c) of the interleave is dst's row c, elements 2p and 2p + 1.
inline void transpose_bf16(const c10::BFloat16* rows, int64_t ld, int64_t n_rows, int64_t n_cols, c10::BFloat16* dst,
                           int64_t ld_dst, uint32_t* words) {
  const int64_t pairs = n_rows / 2;
  put_row_pairs_panels(rows, ld, n_rows, n_cols, words);
  const float* w = reinterpret_cast<const float*>(words);
  float* out = reinterpret_cast<float*>(dst);
  for (int64_t c = 0; c < n_cols; c += 8)
    for (int64_t p = 0; p < pairs; p += 8)
      transpose_8x8<float>(w + (c / 16) * pairs * 16 + p * 16 + c % 16, 16, out + c * (ld_dst / 2) + p, ld_dst / 2);
}

// The calling thread's tiles configured for amx_tile_gemm (eight 16-row x 64-byte tiles,
// palette 1) for the scope's lifetime when the GEMMs run on AMX; released at its end.
class AmxTiles {
 public:
  explicit AmxTiles(Bf16Gemm kind) : on_(kind == Bf16Gemm::kAmx) {
    if (on_) configure();
  }
  ~AmxTiles() {
    if (on_) release();
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

 private:
#ifdef FF_HAVE_BF16_GEMM
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  FF_AMX_TARGET static void configure() {
    Config cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    // GCC 12 does not see LDTILECFG read cfg and dropped the stores above: make them visible.
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  FF_AMX_TARGET static void release() { _tile_release(); }
#else
  static void configure() { TORCH_INTERNAL_ASSERT(false, "AMX tiles at a level without AMX"); }
  static void release() {}
#endif
  bool on_;
};

#ifdef FF_HAVE_BF16_GEMM

// One (16 RT) x (16 CT) block of C (+)= A B over [0, K), RT, CT in {1, 2}.
template <int RT, int CT>
FF_AMX_TARGET inline void amx_block(int64_t K, const c10::BFloat16* a, int64_t lda, const uint32_t* b,
                                    int64_t b_panel, float* c, int64_t ldc, bool accumulate) {
  const int64_t a_stride = lda * 2, c_stride = ldc * 4;  // bytes
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    if constexpr (CT == 2) _tile_loadd(1, c + 16, c_stride);
    if constexpr (RT == 2) _tile_loadd(2, c + 16 * ldc, c_stride);
    if constexpr (RT == 2 && CT == 2) _tile_loadd(3, c + 16 * ldc + 16, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (CT == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(4, a + k, a_stride);
    if constexpr (RT == 2) _tile_loadd(5, a + 16 * lda + k, a_stride);
    _tile_loadd(6, b + k / 2 * 16, 64);
    if constexpr (CT == 2) _tile_loadd(7, b + b_panel + k / 2 * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && CT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  if constexpr (CT == 2) _tile_stored(1, c + 16, c_stride);
  if constexpr (RT == 2) _tile_stored(2, c + 16 * ldc, c_stride);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, c + 16 * ldc + 16, c_stride);
}

// C (+)= A B as described in the header, inside an AmxTiles scope. band: kColsUpTo skips 32 x 32
// blocks of C wholly above the causal diagonal or wholly left of the lower edge (a window's;
// entries it does not skip are all written); kInnerUpTo runs each 32-row block's K range from
// the first to the last 32 values its rows may use (the caller's A is zero outside each row's
// band, so the sums are the same bit for bit). A window (left 512) bf16 forward at (1, 8, 8192,
// 64) on the 2-core AMX Xeon, alternating builds: 18.6-19.1 ms -> 17.5-18.2.
FF_AMX_TARGET inline void amx_tile_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t lda,
                                        const uint32_t* b, float* c, int64_t ldc, bool accumulate = false,
                                        Band band = {}) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(K % kAmxK == 0 && N % 16 == 0 && band.kind != Band::kInnerFrom);
  const int64_t b_panel = K / 2 * 16;  // words per 16-column panel
  for (int64_t j = 0; j < N; j += 32) {
    const bool two_cols = j + 16 < N;
    const uint32_t* b_j = b + (j / 16) * b_panel;
    // kColsUpTo: rows i < j - diag use none of columns >= j.
    const bool cols = band.kind == Band::kColsUpTo, inner = band.kind == Band::kInnerUpTo;
    const int64_t i_begin = cols ? std::max<int64_t>(0, j - band.diag) / 32 * 32 : 0;
    // kColsUpTo: rows past j + 31 - lo_diag use none of columns j .. j + 31.
    const int64_t i_end = cols ? std::min<int64_t>(M, j + 32 - band.lo_diag) : M;
    for (int64_t i = i_begin; i < i_end; i += 32) {
      const bool two_rows = i + 16 < M;
      float* c_ij = c + i * ldc + j;
      // kInnerUpTo: rows i .. i + 31 use K values from i + lo_diag up to i + 31 + diag.
      const int64_t k_end = inner ? std::clamp<int64_t>(round_up_to(std::max<int64_t>(0, i + 32 + band.diag), kAmxK), 0, K)
                                  : K;
      const int64_t k_lo = inner ? std::clamp<int64_t>(std::max<int64_t>(0, i + band.lo_diag) / kAmxK * kAmxK, 0, k_end) : 0;
      const c10::BFloat16* a_i = a + i * lda + k_lo;
      const uint32_t* b_k = b_j + k_lo / 2 * 16;
      const int64_t k_n = k_end - k_lo;
      if (two_rows && two_cols) amx_block<2, 2>(k_n, a_i, lda, b_k, b_panel, c_ij, ldc, accumulate);
      else if (two_rows) amx_block<2, 1>(k_n, a_i, lda, b_k, b_panel, c_ij, ldc, accumulate);
      else if (two_cols) amx_block<1, 2>(k_n, a_i, lda, b_k, b_panel, c_ij, ldc, accumulate);
      else amx_block<1, 1>(k_n, a_i, lda, b_k, b_panel, c_ij, ldc, accumulate);
    }
  }
}

// One 8 x (16 NV) block of C (+)= A B over [0, K): per pair of K values, NV pair-word vectors
// of B and 8 broadcast A words (the pair (i, 2p), 2p + 1 of row i) feed 8 NV VDPBF16PS.
template <int NV>
FF_DOT_TARGET inline void dot_block(int64_t K, const c10::BFloat16* a, int64_t lda, const uint32_t* b,
                                    int64_t b_panel, float* c, int64_t ldc, bool accumulate) {
  constexpr int MR = kDotRows;
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh b_vec[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b_vec[v] = (__m512bh)_mm512_loadu_si512(b + v * b_panel + p * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      uint32_t word;
      std::memcpy(&word, a + i * lda + 2 * p, 4);
      const __m512bh a_pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a_pair, b_vec[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
}

// amx_tile_gemm's contract on VDPBF16PS, by 8 x 32 blocks of C (8 x 16 for a last odd panel),
// every row block of round_up(M, 16). band: kColsUpTo skips the blocks wholly above the causal
// diagonal or left of the lower edge, kInnerUpTo runs each 8-row block's K range from the first
// to the last pair its rows may use.
FF_DOT_TARGET inline void dot_tile_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t lda,
                                        const uint32_t* b, float* c, int64_t ldc, bool accumulate, Band band) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(K % 2 == 0 && N % 16 == 0 && band.kind != Band::kInnerFrom);
  const int64_t b_panel = K / 2 * 16;  // words per 16-column panel
  const int64_t rows = round_up_to(M, 16);
  for (int64_t j = 0; j < N; j += 32) {
    const bool two_cols = j + 16 < N;
    const uint32_t* b_j = b + (j / 16) * b_panel;
    const bool cols = band.kind == Band::kColsUpTo, inner = band.kind == Band::kInnerUpTo;
    const int64_t i_begin = cols ? std::max<int64_t>(0, j - band.diag) / kDotRows * kDotRows : 0;
    const int64_t i_end = cols ? std::min<int64_t>(rows, j + 32 - band.lo_diag) : rows;
    for (int64_t i = i_begin; i < i_end; i += kDotRows) {
      const int64_t k_end = inner ? std::clamp<int64_t>(round_up_to(std::max<int64_t>(0, i + kDotRows + band.diag), 2), 0, K)
                                  : K;
      const int64_t k_lo = inner ? std::clamp<int64_t>(std::max<int64_t>(0, i + band.lo_diag) / 2 * 2, 0, k_end) : 0;
      const c10::BFloat16* a_i = a + i * lda + k_lo;
      const uint32_t* b_k = b_j + k_lo / 2 * 16;
      if (two_cols) dot_block<2>(k_end - k_lo, a_i, lda, b_k, b_panel, c + i * ldc + j, ldc, accumulate);
      else dot_block<1>(k_end - k_lo, a_i, lda, b_k, b_panel, c + i * ldc + j, ldc, accumulate);
    }
  }
}

// C (+)= A B on the call's bf16 instructions (kind: kAmx inside an AmxTiles scope, or kDot).
inline void bf16_tile_gemm(Bf16Gemm kind, int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t lda,
                           const uint32_t* b, float* c, int64_t ldc, bool accumulate, Band band) {
  if (kind == Bf16Gemm::kAmx) amx_tile_gemm(M, N, K, a, lda, b, c, ldc, accumulate, band);
  else dot_tile_gemm(M, N, K, a, lda, b, c, ldc, accumulate, band);
}
#else
inline void bf16_tile_gemm(Bf16Gemm, int64_t, int64_t, int64_t, const c10::BFloat16*, int64_t, const uint32_t*,
                           float*, int64_t, bool, Band) {
  TORCH_INTERNAL_ASSERT(false, "bf16 tile GEMM at a level without AVX-512");
}
#endif  // FF_HAVE_BF16_GEMM

}  // namespace fastformer::cpu::CPU_CAPABILITY
