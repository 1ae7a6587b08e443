// The interface between the bindings (csrc/bindings.cpp, which sees torch tensors) and the CPU
// kernels (csrc/cpu/*.cpp, which see raw pointers, sizes and strides only).
//
// Every kernel file is compiled once per CPU capability level (DEFAULT, AVX2, AVX512; see
// setup.py) into namespace fastformer::cpu::<LEVEL>. The bindings pick one table of function
// pointers at import time from what the running CPU supports.
#pragma once
#include <stdint.h>

#include <algorithm>

#include "common/ff_common.h"

namespace fastformer::cpu {

constexpr int kMaxDims = 8;

// The instructions the AVX-512 level's bf16 attention GEMMs may use (csrc/cpu/bf16_gemm.h):
//   kAmx: the CPU has AMX-TILE and AMX-BF16, the kernel granted the process the tile data state
//         (arch_prctl), and neither FASTFORMER_CPU_AMX=0 nor set_cpu_amx(False) turned it off;
//   kDot: else AVX512-BF16 (VDPBF16PS), unless FASTFORMER_CPU_AVX512_BF16=0 or
//         set_cpu_avx512_bf16(False) turned it off;
//   kFp32: else, the fp32 micro-kernel on fp32 copies.
// Decided on first use (bindings.cpp); the other levels never ask.
enum class Bf16Gemm { kFp32, kDot, kAmx };
Bf16Gemm bf16_gemm_mode();

// Addresses row r of a tensor whose last dimension is contiguous and whose leading dimensions
// have arbitrary strides (transposed views, slices). Dimensions are coalesced by the bindings,
// so the common contiguous case has ndim == 1 and costs one multiply.
struct RowLayout {
  int32_t ndim = 1;
  int64_t sizes[kMaxDims] = {0};
  int64_t strides[kMaxDims] = {0};

  inline int64_t offset(int64_t row) const {
    if (ndim == 1) return row * strides[0];
    int64_t off = 0;
    for (int32_t d = ndim - 1; d >= 0; --d) {
      const int64_t idx = row % sizes[d];
      row /= sizes[d];
      off += idx * strides[d];
    }
    return off;
  }
};

// ---- add + norm ---------------------------------------------------------------------------
struct NormFwdArgs {
  DType dtype;                 // x, residual, y, residual_out
  DType param_dtype;           // weight, bias (== dtype, or f32)
  int64_t rows = 0, hidden = 0;
  double eps = 1e-5;
  bool rms = false;            // RMSNorm (no mean subtraction, no bias)
  const void* x = nullptr;     RowLayout x_rows;
  const void* residual = nullptr; RowLayout residual_rows;  // optional
  const void* weight = nullptr;   // optional (hidden,)
  const void* bias = nullptr;     // optional (hidden,)
  void* y = nullptr;              // contiguous (rows, hidden)
  void* residual_out = nullptr;   // optional, contiguous: x + residual rounded to dtype
  void* mean = nullptr;           // (rows,) f32 (f64 when dtype is f64); unused for RMSNorm
  void* rstd = nullptr;           // (rows,) same type as mean
};

struct NormBwdArgs {
  DType dtype;
  DType param_dtype;
  int64_t rows = 0, hidden = 0;
  bool rms = false;
  const void* dy = nullptr;    RowLayout dy_rows;
  const void* dresidual_out = nullptr; RowLayout dresidual_out_rows;  // optional
  const void* z_a = nullptr;   RowLayout z_a_rows;   // z = z_a (+ z_b, rounded to dtype)
  const void* z_b = nullptr;   RowLayout z_b_rows;   // optional
  const void* weight = nullptr;                       // optional
  const void* mean = nullptr;  const void* rstd = nullptr;
  void* dz = nullptr;          // contiguous (rows, hidden), dtype
  void* dweight = nullptr;     // optional (hidden,) param_dtype
  void* dbias = nullptr;       // optional (hidden,) param_dtype
};

// ---- attention ----------------------------------------------------------------------------
// A 4-D tensor view: element (b, h, l, d) at ptr + b*s[0] + h*s[1] + l*s[2] + d*s[3].
struct View4 {
  const void* ptr = nullptr;
  int64_t s[4] = {0, 0, 0, 0};
};

struct AttnArgs {
  DType dtype;                       // q, k, v, out, dout, dq, dk, dv
  int64_t B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0, Dv = 0;
  View4 q, k, v;                     // (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv); d stride 1
  View4 attn_mask;                   // (B, H, Lq, Lk) broadcast view, or ptr == nullptr
  bool mask_is_bool = false;         // bool: true = attend; else float added to the scores
  DType mask_dtype = DType::f32;     // dtype of a float mask
  const bool* key_padding_mask = nullptr;  // (B, Lk), true = padding
  int64_t kpm_s[2] = {0, 0};
  int32_t causal = 0;                // 0 none, 1 top-left (j <= i), 2 bottom-right (j <= i + Lk - Lq)
  double scale = 1.0;
  double dropout_p = 0.0;
  uint64_t seed = 0, offset = 0;
  // The variants (semantics: fastformer/reference/attention.py; d = Lk - Lq for causal 2):
  int64_t window_left = -1;          // keys j >= i + d - left (-1: no limit)
  int64_t window_right = -1;         // keys j <= i + d + right
  double softcap = 0.0;              // > 0: s = softcap * tanh(s / softcap)
  const float* alibi_slopes = nullptr;  // slope of (b, h) at b * alibi_s[0] + h * alibi_s[1]
  int64_t alibi_s[2] = {0, 0};
  const void* sinks = nullptr;       // (H,) in the accumulation type: a logit per head
  const void* rel_bias = nullptr;    // (H, Lq + Lk - 1 + 64) accumulation type, contiguous: the
                                     //   bias of key j for query i at [h, j - i + Lq - 1]
  // Variable lengths (fastformer/ops/varlen.py; the kernels split such a call into one call
  // per sequence, attention_sequences.h's split_sequences, or decode it, attention_decode.cpp):
  //   packed: B = 1, the views (1, H, total, D); sequence s is rows cu_q[s] .. cu_q[s + 1] of q
  //   and cu_k[s] .. cu_k[s + 1] of k / v (n_seqs of them; ALiBi slopes (S, H): row s);
  //   a KV cache: batch row b's keys are rows 0 .. k_lens[b] (the band's d: k_lens[b] - Lq),
  //   or k_starts[b] .. k_lens[b] with k_starts (left padding: the row is read as if it began
  //   there, so its key j is cache row k_starts[b] + j and d is k_lens[b] - k_starts[b] - Lq);
  //   paged: k, v are (blocks, Hkv, block_size, D), key j of row b in block
  //   block_table[b * bt_stride + j / block_size] (the decode kernel reads them; the bindings
  //   gather pages for other calls).
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int64_t n_seqs = 0;
  const int32_t* k_lens = nullptr;
  const int32_t* k_starts = nullptr;
  const int32_t* block_table = nullptr;
  int64_t bt_stride = 0, block_size = 0;
  // backward outputs of the differentiable options (accumulation type; null: not needed)
  void* dmask = nullptr;             // d attn_mask, zeroed by the caller, the mask's own shape as
  int64_t dmask_s[4] = {0, 0, 0, 0}; //   (B, H, Lq, Lk) strides with 0 on broadcast dims (summed)
  bool dmask_in_dtype = false;       // dmask holds the inputs' dtype and broadcasts over no dim:
                                     //   each entry is written once (rounded once), not added to
  void* dsinks = nullptr;            // (B, H): the sink gradient per batch row and head
  void* drel = nullptr;              // d rel_bias, rel_bias's layout
  // forward outputs / backward inputs
  View4 out;                         // (B, H, Lq, Dv)
  View4 out_residual;                // bf16 / fp16, or ptr == nullptr: the output's rounding
                                     //   residual (fp32 output - out, rounded; store_out_row)
  void* lse = nullptr;               // (B, H, Lq): row (b, h, i) at b * lse_s[0] + h * lse_s[1] + i,
  int64_t lse_s[2] = {0, 0};         //   f32 (f64 for f64 inputs)
  // backward only
  View4 dout;                        // (B, H, Lq, Dv)
  View4 dq, dk, dv;                  // outputs, same shapes as q, k, v
};

// ---- rotary position embedding -----------------------------------------------------------------
struct RotaryArgs {
  DType dtype;                       // x and out; the tables are f32 (f64 for f64)
  int64_t B = 0, H = 0, L = 0, D = 0;
  int64_t rot_dim = 0;               // R: channels rotated (even, <= D); the rest pass through
  View4 x;                           // (B, H, L, D), d stride 1
  View4 out;                         // (B, H, L, D), d stride 1 (written)
  const void* cos = nullptr;         // (L, R/2) contiguous
  const void* sin = nullptr;         // (L, R/2) contiguous
  bool interleaved = false;          // pairs (2i, 2i+1) instead of (i, i + R/2)
  bool conj = false;                 // rotate by -theta (the backward)
};

// ---- DeBERTa's disentangled relative-position bias ---------------------------------------------
// Semantics and algorithm: csrc/cpu/relative_bias.cpp. Every tensor contiguous.
struct RelativeBiasArgs {
  DType dtype;                       // c2p, p2c, out, dout, dc2p, dp2c
  int64_t B = 0, H = 0, Lq = 0, Lk = 0, W = 0;
  int64_t Bv = 1;                    // visible's batch: 1 (shared) or B
  const void* c2p = nullptr;         // (B, H, Lq, W), or null (no content -> position term)
  const void* p2c = nullptr;         // (B, H, Lk, W), or null (no position -> content term)
  const int32_t* c2p_index = nullptr;  // (Lq, Lk), values in [0, W)
  const int32_t* p2c_index = nullptr;  // (Lq, Lk): key j's row of p2c at column p2c_index[i, j]
  const bool* visible = nullptr;     // (Bv, Lq, Lk), true = attend; null: all
  void* out = nullptr;               // forward: (B, H, Lq, Lk)
  const void* dout = nullptr;        // backward: (B, H, Lq, Lk)
  void* dc2p = nullptr;              // backward outputs, null when not wanted
  void* dp2c = nullptr;
};

// ---- feed-forward block -------------------------------------------------------------------
// A 2-D matrix view: element (r, c) at ptr + rows.offset(r) + c * col_stride (in elements).
struct MatView {
  const void* ptr = nullptr;
  RowLayout rows;
  int64_t col_stride = 1;
};

// The layers one FfnArgs call runs: the whole block, or one half of it as its own autograd
// node (fastformer/ops/ffn.py, the gated eager route):
//   kFfnFirst, not gated: a linear layer pre = x W1^T + b1 (no activation, no dropout); the
//     forward stores pre in hidden_buf, the backward reads pre's gradient from d_hidden.
//   kFfnSecond: y = h W2^T + b2 with h recomputed from the saved pre-activation; the backward
//     writes dw2, db2 and (d_hidden given) the pre-activation's gradient.
enum FfnLayers : int32_t { kFfnFirst = 1, kFfnSecond = 2, kFfnBoth = 3 };

// y = act(x W1^T + b1) W2^T + b2 (dropout on the hidden activation), or gated:
// y = (act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd, with w1/b1 = gate, w_up/b_up = up,
// w2/b2 = down. Semantics: fastformer/reference/ffn.py; algorithm: csrc/cpu/ffn.cpp.
struct FfnArgs {
  DType dtype;                       // every tensor (x, weights, biases, outputs, gradients)
  int32_t activation = 0;            // fastformer::Activation (common/activations.h)
  bool gated = false;
  int32_t layers = kFfnBoth;
  int64_t tokens = 0, d_model = 0, hidden = 0;
  double dropout_p = 0.0;            // ffn only: dropout on act(pre), Philox (common/philox.h)
  uint64_t seed = 0, offset = 0;     //   element index token * hidden + unit
  MatView x;                         // (tokens, d_model)
  MatView w1, w_up;                  // (hidden, d_model); w_up gated only
  MatView w2;                        // (d_model, hidden)
  const void* b1 = nullptr;          // optional (hidden,), contiguous
  const void* b_up = nullptr;        // optional (hidden,), gated only
  const void* b2 = nullptr;          // optional (d_model,)
  // Forward. hidden_buf, contiguous: with store_preactivation, the pre-activation x W1^T + b1
  // (tokens, hidden) or gated [gate | up] (tokens, 2 * hidden) that the backward reads; else
  // the post-activation h (tokens, hidden), a temporary.
  void* y = nullptr;                 // (tokens, d_model) contiguous
  void* hidden_buf = nullptr;
  bool store_preactivation = false;
  // saved: the pre-activation GEMM2 and the backward read (hidden_buf of a store_preactivation
  // forward of the whole block). Not gated: (tokens, hidden) contiguous. Gated: gate rows at
  // saved, up rows at saved_up, both with row stride saved_ld (the whole block's [gate | up]:
  // saved_up = saved + hidden, saved_ld = 2 * hidden). d_hidden (/ d_up, row stride d_ld):
  // the pre-activation's gradient, laid out alike; the whole block's is [d gate | d up]
  // contiguous. Null outputs are skipped.
  MatView dy;                        // (tokens, d_model)
  const void* saved = nullptr;
  const void* saved_up = nullptr;
  int64_t saved_ld = 0;
  void* d_hidden = nullptr;
  void* d_up = nullptr;
  int64_t d_ld = 0;
  void* dx = nullptr;                // (tokens, d_model) contiguous
  void* dw1 = nullptr;               // (hidden, d_model) contiguous, as w1 (gated: d w_gate)
  void* db1 = nullptr;
  void* dw_up = nullptr;
  void* db_up = nullptr;
  void* dw2 = nullptr;               // (d_model, hidden) contiguous
  void* db2 = nullptr;
};

// The FFN's activation / gate as one elementwise pass (csrc/cpu/ffn_elementwise.cpp):
//   forward (dh == nullptr): h = act(gate) [* up]
//   backward: d_gate = dh [* up] * act'(gate), d_up = dh * act(gate), h (when h != nullptr)
// Every matrix (rows, cols) with column stride 1 and the given row stride (ld_*).
struct FfnActArgs {
  DType dtype;                       // every tensor
  int32_t activation = 0;            // fastformer::Activation
  int64_t rows = 0, cols = 0;
  const void* gate = nullptr;        // the pre-activation
  int64_t ld_gate = 0;
  const void* up = nullptr;          // gated: the up projection; nullptr: not gated
  int64_t ld_up = 0;
  const void* dh = nullptr;          // backward: the gradient of h; nullptr: forward
  int64_t ld_dh = 0;
  void* h = nullptr;                 // forward: required; backward: optional
  int64_t ld_h = 0;
  void* d_gate = nullptr;            // backward
  int64_t ld_d_gate = 0;
  void* d_up = nullptr;              // backward, gated
  int64_t ld_d_up = 0;
  double dropout_p = 0.0;            // h *= keep / (1 - p), keep = Philox(seed, offset + r * cols + c)
  uint64_t seed = 0, offset = 0;     //   >= dropout_threshold(p) (ffn.cpp's mask, element for element)
  bool identity = false;             // no activation, no up: h = gate * keep / (1 - p) (dropout alone)
  double limit = 0.0;                // gated, > 0: gate clamped above at limit, up to [-limit, limit]
                                     //   before act(gate) * up (DeepSeek-V4); 0: no clamp
  double up_shift = 0.0;             // gated: h = act(gate) * (up + up_shift) (gpt-oss: 1, after the clamp)
};

// y = x W^T (+ b) for a few rows of x (csrc/cpu/linear_rows.cpp): the decode-time projections.
struct LinearRowsArgs {
  DType dtype;                       // the weight's and bias' (f32, bf16, f16); x and y are f32
  int64_t rows = 0;                  // 1..8 (any with x_t)
  int64_t in_features = 0, out_features = 0;
  const void* weight = nullptr;      // (out, in), row stride ld_weight, column stride 1
  int64_t ld_weight = 0;
  bool weight_in_major = false;      // instead: stored (in, out), row stride ld_weight (rows 1..8,
                                     // x as below; x_t and x_bf16 unused)
  const float* x = nullptr;          // (rows, in) contiguous
  const void* bias = nullptr;        // (out,) contiguous in the weight's dtype, or nullptr
  float* y = nullptr;                // (rows, out) contiguous
  // f32 weights, 3 or more rows: x transposed instead, (in, ld_x_t) with ld_x_t a multiple of
  // 16 >= rows, the padding columns zero; x is then unused.
  const float* x_t = nullptr;
  int64_t ld_x_t = 0;
  // bf16 weights, AMX or AVX512-BF16 in use (the avx512 level; bf16_gemm_mode()), in a multiple
  // of 32: x as bf16 rows (rows, in) contiguous instead; x and x_t are then unused.
  const void* x_bf16 = nullptr;
};

// Weight gradient of a linear layer in bf16 on AMX (csrc/cpu/weight_grad.cpp): C (m x n) = P^T Q
// with P (k x m) and Q (k x n) bf16, one row per token.
struct WeightGradArgs {
  int64_t k = 0, m = 0, n = 0;       // tokens, rows of C, columns of C
  const void* p = nullptr;           // (k, m) bf16, row stride ld_p, column stride 1
  int64_t ld_p = 0;
  const void* q = nullptr;           // (k, n) bf16, row stride ld_q, column stride 1
  int64_t ld_q = 0;
  DType out_dtype;                   // bf16 or f32
  void* c = nullptr;                 // C (i, j) at c + i * ld_c + j; transpose_c: at c + j * ld_c + i
  int64_t ld_c = 0;
  bool transpose_c = false;
  void* workspace = nullptr;         // WeightGradLayout(k, n).bytes, 64-byte aligned
};

constexpr int64_t kWeightGradBlockM = 256;   // columns of P packed at a time (rows of C)
constexpr int64_t kWeightGradBlockK = 2048;  // rows of P and Q per pass (a 1 MB A block)

// The workspace of weight_grad: Q packed whole, one A block, the partial sums of one block of
// C's rows when K spans more than one pass (offsets 64-byte aligned).
struct WeightGradLayout {
  int64_t kp, np, q_offset, a_offset, partial_offset, bytes;
  WeightGradLayout(int64_t k, int64_t n) {
    const auto up = [](int64_t v, int64_t to) { return (v + to - 1) / to * to; };
    kp = up(k, 32);
    np = up(n, 32);
    q_offset = 0;
    a_offset = up(np * kp * 2, 64);
    partial_offset = a_offset + up(kWeightGradBlockM * std::min(kp, kWeightGradBlockK) * 2, 64);
    bytes = partial_offset + (kp > kWeightGradBlockK ? kWeightGradBlockM * np * 4 : 0);
  }
};

// ---- linear cross-entropy ------------------------------------------------------------------
// The row pass over one chunk of logits of ff.linear_cross_entropy (the chunk loop and its GEMMs:
// fastformer/reference/linear_cross_entropy.py; the kernels: csrc/cpu/linear_cross_entropy.cpp).
struct LceRowsArgs {
  DType dtype;                       // the logits (read, then overwritten by their gradient)
  int64_t rows = 0, vocab = 0;
  void* logits = nullptr;            // (rows, vocab) contiguous
  const int64_t* target = nullptr;   // (rows,) contiguous
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double softcap = 0.0;              // > 0: s = softcap * tanh(z / softcap)
  bool compute_loss = true;          // write loss and lse; false: read lse (a backward)
  void* loss = nullptr;              // (rows,) accumulation type (f32; f64 for f64)
  void* lse = nullptr;               // (rows,) accumulation type
  bool write_grad = false;           // overwrite the logits with d loss_r / d z, times the scales
  double grad_scale = 1.0;
  const void* row_scale = nullptr;   // optional (rows,) accumulation type: a factor per row
  void* dbias = nullptr;             // optional (vocab,) f64: += column sums of the gradient
};

// hi + lo += p, elementwise: a compensated accumulation in a pair of bf16 / f16 buffers.
struct PairAddArgs {
  DType dtype;
  int64_t n = 0;
  void* hi = nullptr;                // n contiguous elements each
  void* lo = nullptr;                // null when neither read nor written
  const void* p = nullptr;
  bool read_lo = true;               // false: lo holds nothing yet (taken as 0, not read)
  bool write_lo = true;              // false: the last addition (hi = round(hi + lo + p))
};

// X-macro list of kernels: X(name, ArgsType). Add a kernel here and in one .cpp file.
#define FF_CPU_KERNELS(X)          \
  X(add_norm_fwd, NormFwdArgs)     \
  X(add_norm_bwd, NormBwdArgs)     \
  X(attention_fwd, AttnArgs)       \
  X(attention_bwd, AttnArgs)       \
  X(ffn_fwd, FfnArgs)              \
  X(ffn_bwd, FfnArgs)              \
  X(ffn_act, FfnActArgs)           \
  X(linear_rows, LinearRowsArgs)   \
  X(weight_grad, WeightGradArgs)   \
  X(rotary, RotaryArgs)            \
  X(relative_bias_fwd, RelativeBiasArgs) \
  X(relative_bias_bwd, RelativeBiasArgs) \
  X(lce_rows, LceRowsArgs)         \
  X(lce_pair_add, PairAddArgs)

#define FF_DECLARE_KERNEL(name, Args) void name(const Args& args);
#define FF_DECLARE_LEVEL(LEVEL) \
  namespace LEVEL {             \
  FF_CPU_KERNELS(FF_DECLARE_KERNEL) \
  }
FF_DECLARE_LEVEL(DEFAULT)
FF_DECLARE_LEVEL(AVX2)
FF_DECLARE_LEVEL(AVX512)
#undef FF_DECLARE_LEVEL
#undef FF_DECLARE_KERNEL

struct KernelTable {
#define FF_TABLE_ENTRY(name, Args) void (*name)(const Args&) = nullptr;
  FF_CPU_KERNELS(FF_TABLE_ENTRY)
#undef FF_TABLE_ENTRY
};

}  // namespace fastformer::cpu
