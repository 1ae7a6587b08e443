// The weight gradient of a linear layer, bf16 on AMX tiles: C (M x N) = P^T Q, where P (K x M)
// and Q (K x N) are bf16 matrices with one row per token (K = tokens). dW = dY^T X is P = dY,
// Q = X; dW^T = X^T dY (C stored transposed) lets the caller put the narrower of the two in Q.
//
// Why: autograd's weight gradient is mm(grad.t(), input), a GEMM whose A operand is transposed,
// and torch's CPU bf16 mm runs that case at 0.77-0.86 TFLOP/s on the 2-core AMX Xeon where the
// forward's x W^T runs at 1.7-2.0 (SwiGLU (2048, 4096, 11008)'s six GEMM shapes, best of 5):
// the three weight gradients are half of an eager SwiGLU forward+backward.
//
// Operands, packed once per call (the caller's workspace, weight_grad_workspace_bytes()):
//   Q whole as bf16_gemm.h's pair-word B operand: 16-column panels of Kp / 2 words, rows of Q
//     interleaved in pairs (put_row_pairs_panels_of; Kp = K rounded up to 32, zero rows past K,
//     zero columns past N up to a multiple of 32);
//   P per block of kBlockM columns and kBlockK rows as AMX A tiles: per 16 columns of P and 32
//     rows, one 16 x 32 tile, row i holding column i of P over the 32 rows: two rows of P
//     interleaved into pair words, then a 16 x 16 transpose of the words (bit moves only).
// Loop: per (column block of P, row block of K): the threads pack the A block's panels, then
//   split C's 32-column pairs of panels; per 32 rows of C a 2 x 2 block of tiles (tmm0-3) runs
//   over the block's K with the A and B tile rows two K steps ahead prefetched, and is stored
//   to C (the last K block: rounded to the output's dtype) or to an fp32 partial-sum block
//   (kBlockM x N) the next K block loads. Traffic per 32 x 32 x 32 step: four 1 KB tiles from
//   L1 / L2 (the A block, 1 MB, stays in L2), Q's panels are read kBlockM rows of C at a time.
// Measured on the 2-core AMX Xeon: see fastformer/ops/linear.py (weight_grad).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "cpu/bf16_gemm.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {

#ifdef FF_HAVE_BF16_GEMM
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kTileWords = 16 * 16;   // one 16 x 32 bf16 tile, in 32-bit words
constexpr int64_t kPrefetchSteps = 2;     // K steps of 32 ahead

struct Shape {
  int64_t kp, np, mp;  // K, N, M rounded up to 32
};

// The A tiles of P's columns [m0, m0 + 32) x rows [k0, k0 + 32 * steps) (zeros past M and K):
// two 16-column panels of `steps` tiles each, at dst and dst + steps * kTileWords.
inline void pack_a_pair(const WeightGradArgs& a, int64_t m0, int64_t k0, int64_t steps, uint32_t* dst) {
  const bf16* p = static_cast<const bf16*>(a.p);
  const int64_t cols = std::min<int64_t>(32, a.m - m0);
  alignas(64) uint32_t words[2 * kTileWords];  // two panels of 16 pairs x 16 columns
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t r0 = k0 + 32 * s;
    const auto row_of = [&](int64_t r) -> const bf16* { return r0 + r < a.k ? p + (r0 + r) * a.ld_p + m0 : nullptr; };
    put_row_pairs_panels_of(row_of, 32, cols, 32, words);
    for (int half = 0; half < 2; ++half) {
      const float* src = reinterpret_cast<const float*>(words + half * kTileWords);
      float* tile = reinterpret_cast<float*>(dst + (half * steps + s) * kTileWords);
      for (int pb = 0; pb < 16; pb += 8)
        for (int cb = 0; cb < 16; cb += 8) transpose_8x8<float>(src + pb * 16 + cb, 16, tile + cb * 16 + pb, 16);
    }
  }
}

// Rows [0, rows) x columns [0, cols) of a 32 x 32 fp32 block to C at (i0, j0), as C or C^T.
inline void store_block(const WeightGradArgs& a, const float* blk, int64_t i0, int64_t j0) {
  using V = Vectorized<float>;
  const int64_t rows = std::min<int64_t>(32, a.m - i0), cols = std::min<int64_t>(32, a.n - j0);
  alignas(64) float t[32 * 32];
  int64_t out_rows = rows, out_cols = cols;
  if (a.transpose_c) {
    for (int64_t r = 0; r < 32; r += 8)
      for (int64_t c = 0; c < 32; c += 8) transpose_8x8<float>(blk + r * 32 + c, 32, t + c * 32 + r, 32);
    blk = t;
    std::swap(out_rows, out_cols);
    std::swap(i0, j0);
  }
  const auto put = [&](auto* out) {
    for (int64_t r = 0; r < out_rows; ++r)
      for (int64_t c = 0; c < out_cols; c += V::size())
        store_acc(out + (i0 + r) * a.ld_c + j0 + c, V::loadu(blk + r * 32 + c), std::min<int64_t>(V::size(), out_cols - c));
  };
  if (a.out_dtype == DType::bf16) put(static_cast<bf16*>(a.c));
  else put(static_cast<float*>(a.c));
}

// A 32 x 32 block of C over one K block: 2 x 2 tiles, started from zero or from the partial sums
// at load_from (row stride ld_load), stored at store_to (row stride ld_store).
FF_AMX_TARGET inline void tile_block(const uint32_t* a0, const uint32_t* a1, const uint32_t* b0, const uint32_t* b1,
                                     int64_t steps, const float* load_from, int64_t ld_load, float* store_to,
                                     int64_t ld_store) {
  if (load_from) {
    const int64_t stride = ld_load * 4;
    _tile_loadd(0, load_from, stride);
    _tile_loadd(1, load_from + 16, stride);
    _tile_loadd(2, load_from + 16 * ld_load, stride);
    _tile_loadd(3, load_from + 16 * ld_load + 16, stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    // Prefetch reads past the block's end harmlessly (no fault); measured +35% on this loop.
    const char* ahead[4] = {reinterpret_cast<const char*>(a0 + (s + kPrefetchSteps) * kTileWords),
                            reinterpret_cast<const char*>(a1 + (s + kPrefetchSteps) * kTileWords),
                            reinterpret_cast<const char*>(b0 + (s + kPrefetchSteps) * kTileWords),
                            reinterpret_cast<const char*>(b1 + (s + kPrefetchSteps) * kTileWords)};
    for (const char* t : ahead)
      for (int line = 0; line < 16; ++line) _mm_prefetch(t + 64 * line, _MM_HINT_T0);
    _tile_loadd(4, a0 + s * kTileWords, 64);
    _tile_loadd(6, b0 + s * kTileWords, 64);
    _tile_loadd(5, a1 + s * kTileWords, 64);
    _tile_loadd(7, b1 + s * kTileWords, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t stride = ld_store * 4;
  _tile_stored(0, store_to, stride);
  _tile_stored(1, store_to + 16, stride);
  _tile_stored(2, store_to + 16 * ld_store, stride);
  _tile_stored(3, store_to + 16 * ld_store + 16, stride);
}

}  // namespace

void weight_grad(const WeightGradArgs& a) {
  TORCH_CHECK(bf16_gemm_mode() == Bf16Gemm::kAmx, "fastformer: weight_grad runs on AMX tiles only");
  const WeightGradLayout L(a.k, a.n);
  char* ws = static_cast<char*>(a.workspace);
  uint32_t* q_panels = reinterpret_cast<uint32_t*>(ws + L.q_offset);
  uint32_t* a_block = reinterpret_cast<uint32_t*>(ws + L.a_offset);
  float* partial = reinterpret_cast<float*>(ws + L.partial_offset);
  const int64_t kp = L.kp, pairs_n = L.np / 32;
  const bf16* q = static_cast<const bf16*>(a.q);

  // Q's 32-column chunks, one per task.
  at::parallel_for(0, pairs_n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t c0 = 32 * j;
      const auto row_of = [&](int64_t r) -> const bf16* { return r < a.k ? q + r * a.ld_q + c0 : nullptr; };
      put_row_pairs_panels_of(row_of, kp, std::min<int64_t>(32, a.n - c0), 32, q_panels + (c0 / 16) * (kp / 2) * 16);
    }
  });

  for (int64_t m0 = 0; m0 < a.m; m0 += kWeightGradBlockM) {
    const int64_t mp = round_up_to(std::min(kWeightGradBlockM, a.m - m0), int64_t{32});
    for (int64_t k0 = 0; k0 < kp; k0 += kWeightGradBlockK) {
      const int64_t steps = std::min(kWeightGradBlockK, kp - k0) / 32;
      const bool first = k0 == 0, last = k0 + kWeightGradBlockK >= kp;
      at::parallel_for(0, mp / 32, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) pack_a_pair(a, m0 + 32 * i, k0, steps, a_block + 2 * i * steps * kTileWords);
      });
      at::parallel_for(0, pairs_n, 1, [&](int64_t begin, int64_t end) {
        AmxTiles tiles(Bf16Gemm::kAmx);
        alignas(64) float blk[32 * 32];
        for (int64_t j = begin; j < end; ++j) {
          const uint32_t* b0 = q_panels + (2 * j) * (kp / 2) * 16 + k0 / 2 * 16;
          const uint32_t* b1 = b0 + (kp / 2) * 16;
          for (int64_t i = 0; i < mp; i += 32) {
            const uint32_t* a0 = a_block + (i / 16) * steps * kTileWords;
            float* part = partial + i * L.np + 32 * j;  // this block's partial sums (K > kBlockK)
            const float* start = first ? nullptr : part;
            if (last) {
              tile_block(a0, a0 + steps * kTileWords, b0, b1, steps, start, L.np, blk, 32);
              store_block(a, blk, m0 + i, 32 * j);
            } else {
              tile_block(a0, a0 + steps * kTileWords, b0, b1, steps, start, L.np, part, L.np);
            }
          }
        }
      });
    }
  }
}

#else

void weight_grad(const WeightGradArgs&) {
  TORCH_CHECK(false, "fastformer: weight_grad runs on AMX tiles only (the AVX-512 level)");
}

#endif

}  // namespace fastformer::cpu::CPU_CAPABILITY
