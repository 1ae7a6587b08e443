// Per-thread scratch buffers of the CPU kernels, requested by named slot.
//
// thread_scratch<T, Scratch::kName>(n) returns n elements of T that stay the calling thread's
// across calls: a fresh allocation per call costs page faults (measured 1.5x on the add+norm
// backward at (512, 768)). Buffers live at the same time must have different slots; every slot
// is named once in the enum below, so two live buffers cannot share one by accident (a slot is
// reused only by code that never holds it at the same time as another user: the forward and
// the backward of an op, say). Initialised on first use, never at load time. Every buffer is
// 64-byte aligned: packed GEMM panels are rows of 64 bytes, and on a malloc'd (16-byte aligned)
// buffer every other 32-byte load of them split a cache line. Contents do not persist across
// calls that grow the buffer.
#pragma once
#include <stdint.h>

#include <cstdint>
#include <vector>

namespace fastformer::cpu {

enum class Scratch : int {
  // add + norm (norm.cpp)
  kNormRows,           // forward: z = x + residual of a row; backward: x_hat of a row group
  kNormWeight,         // weight in the accumulation type, zero padded
  kNormBias,
  kNormDyRows,         // backward: dy of a row group
  kNormDweightParts,   // backward: fp64 partial d weight / d bias per row block
  kNormDbiasParts,
  kNormColumnTotals,   // backward: the ordered sum of the partials

  // attention forward (attention_fwd.cpp)
  kFwdQStage,          // one MR-row panel's Q rows, fp32
  kFwdQPanels,         // the query block's Q in MR-row panels
  kFwdQBf16,           // bf16 GEMMs: the block's bf16 Q rows
  kFwdPHi,             // bf16 GEMMs: P = p_hi + p_lo, two bf16 parts
  kFwdPLo,
  kFwdScores,          // the S / P tile
  kFwdAcc,             // the output accumulator
  kFwdBias,            // one score row's bias (masks)
  kFwdRowMax,
  kFwdRowSum,
  kFwdQNorm,           // |q_i|^2 of the block's query rows (the score bound)

  // attention backward (attention_bwd.cpp)
  kBwdDqPartials,      // fp32 dQ partials per key chunk (shared by the tasks)
  kBwdQPanels,         // Q, dO of a head in MR-row panels (A operands)
  kBwdDoPanels,
  kBwdQStage,          // one MR-row panel's rows
  kBwdDoStage,
  kBwdQCols,           // Q, dO in column panels (B operands)
  kBwdDoCols,
  kBwdDkAcc,           // dK, dV accumulators of the task's keys
  kBwdDvAcc,
  kBwdP,               // P, dS and (dropout) P' tiles
  kBwdDs,
  kBwdPDropped,
  kBwdBias,
  kBwdDelta,           // delta = rowsum(dO * O) of the current head
  kBwdDqOwn,           // dQ of the head when the task owns it
  kBwdSoftcapGrad,     // softcap: 1 - tanh^2 of a row's scores
  kBwdRelParts,        // the tasks' parts of d rel_bias (shared by the tasks)
  kBwdQBf16,           // bf16 GEMMs: bf16 rows of Q, dO and their transposes
  kBwdDoBf16,
  kBwdQtBf16,
  kBwdDotBf16,
  kBwdTransposeWords,
  kBwdPBf16,           // bf16 GEMMs: P', dS rounded to bf16, and as query-pair words
  kBwdDsBf16,
  kBwdPPairs,
  kBwdDsPairs,
  kBwdDktAcc,          // bf16 GEMMs: dK^T, dV^T accumulators
  kBwdDvtAcc,

  // attention decoding (attention_decode.cpp)
  kDecQStage,
  kDecQPanels,
  kDecScores,
  kDecAcc,
  kDecBias,
  kDecRowMax,
  kDecRowSum,
  kDecRowMaxParts,     // the key splits' partial results (shared by the tasks)
  kDecRowSumParts,
  kDecAccParts,
  kDecMerged,          // one row merged from its splits
  kDecQBf16,           // bf16 instructions: Q's rows, Q^T as pair words, S^T, a staged key
  kDecQPairs,          // group, V as pair words, P's bf16 parts
  kDecScoresT,
  kDecKStage,
  kDecVPairs,
  kDecPHi,
  kDecPLo,

  // packed K / V blocks (attention_common.h, Packed and pack_kv_block)
  kPackKt,
  kPackVt,
  kPackKp,
  kPackVp,
  kPackKw,
  kPackKNorm,          // forward: the largest |k_j|^2 of each packed key block
  kPackVw,
  kPackKpw,
  kPackVpw,
  kPackKRows,          // a key block's rows in fp32, staged
  kPackVRows,
  kPackBf16Rows,       // bf16 GEMMs: a key block's bf16 rows, staged
  kPackPaddedRow,      // a row zero padded to the panels' width

  // packed GEMM (gemm_packed.h) and the FFN (ffn.cpp)
  kGemmAPack,
  kGemmBPack,
  kGemmWorkspace,      // K-partial sums, tile by tile
  kFfnSegment,         // a packer's row segment
  kFfnStage,           // the transposing packers' staged rows
  kFfnBias1,           // biases in the accumulation type, zero padded
  kFfnBias2,
  kFfnBiasUp,

  kZeroRow,            // zero_row(): never written
};

}  // namespace fastformer::cpu

// In each capability level's namespace (this header is compiled once per level, with that
// level's instruction set): one shared inline definition could be linked from the AVX-512
// copy and run on a CPU without AVX-512.
namespace fastformer::cpu::CPU_CAPABILITY {

template <typename T, Scratch kSlot>
inline T* thread_scratch(int64_t n) {
  constexpr int64_t kAlign = 64, kSlack = (kAlign + sizeof(T) - 1) / sizeof(T);
  static thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n + kSlack) buf.resize(n + kSlack);
  const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
  return buf.data() + ((kAlign - addr % kAlign) % kAlign) / sizeof(T);
}

// n zeros, read in place as the rows past a block's or a panel's end: the buffer starts
// value-initialised, only grows, and nothing writes it.
template <typename T>
inline const T* zero_row(int64_t n) {
  return thread_scratch<T, Scratch::kZeroRow>(n);
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
