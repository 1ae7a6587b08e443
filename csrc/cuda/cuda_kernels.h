// Host-side declarations of the CUDA launchers. Plain pointers, sizes and strides: this header
// includes no torch header, so it is shared by the .cu files (nvcc) and the bindings (g++).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "common/activations.h"
#include "common/ff_common.h"

namespace fastformer::cuda {

struct NormFwdParams {
  DType dtype, param_dtype;
  int64_t rows = 0, hidden = 0;
  float eps = 1e-5f;
  bool rms = false;
  const void* x = nullptr;        int64_t x_row_stride = 0;         // last dim contiguous
  const void* residual = nullptr; int64_t residual_row_stride = 0;  // optional
  const void* weight = nullptr;   const void* bias = nullptr;       // optional (hidden,)
  void* y = nullptr;              // (rows, hidden) contiguous
  void* residual_out = nullptr;   // optional (rows, hidden) contiguous
  float* mean = nullptr;          // (rows,), unused for RMSNorm
  float* rstd = nullptr;          // (rows,)
};

struct NormBwdParams {
  DType dtype, param_dtype;
  int64_t rows = 0, hidden = 0;
  bool rms = false;
  const void* dy = nullptr;   int64_t dy_row_stride = 0;
  const void* dres = nullptr; int64_t dres_row_stride = 0;  // grad of residual_out, optional
  const void* z_a = nullptr;  int64_t z_a_row_stride = 0;   // z = z_a (+ z_b, rounded)
  const void* z_b = nullptr;  int64_t z_b_row_stride = 0;   // optional
  const void* weight = nullptr;
  const float* mean = nullptr; const float* rstd = nullptr;
  void* dz = nullptr;                                  // (rows, hidden) contiguous
  float* dw_part = nullptr; float* db_part = nullptr;  // (num_blocks, hidden) scratch, optional
  void* dweight = nullptr;  void* dbias = nullptr;     // (hidden,) param_dtype, optional
  int num_blocks = 0;       // grid of the row kernel; see norm_bwd_blocks()
};

int norm_bwd_blocks(int64_t rows, int sm_count);
cudaError_t add_norm_fwd(const NormFwdParams& p, cudaStream_t stream);
cudaError_t add_norm_bwd(const NormBwdParams& p, cudaStream_t stream);

// ---- attention (attention_fwd.cu, attention_bwd.cu) -------------------------------------------
// A (B, heads, L, head_dim) tensor: element (b, h, i, d) at data[b*batch + h*head + i*row + d].
// Strides in elements; the kernels need data 16-byte aligned and the strides multiples of 8.
template <typename Ptr>
struct HeadTensor {
  Ptr data = nullptr;
  int64_t batch = 0, head = 0, row = 0;
};
using HeadsIn = HeadTensor<const void*>;
using HeadsOut = HeadTensor<void*>;

struct AttentionShape {
  DType dtype = DType::f16;  // f16 or bf16 (q, k, v, out and the gradients)
  int head_dim = 64;         // 64 or 128
  int64_t batch = 0, heads = 0, kv_heads = 0;  // heads % kv_heads == 0 (GQA/MQA)
  int len_q = 0, len_k = 0;
  float scale = 1.f;
  int causal = 0;            // 0 none, 1 top-left (j <= i), 2 bottom-right (j <= i + Lk - Lq)
  // Sliding window: key j is visible to query i iff i + d - window_left <= j <= i + d +
  // window_right, d = Lk - Lq for causal 2, else 0; -1: no limit on that side (causal adds
  // right = 0). Any value >= -1 (a window wider than the sequences is no limit).
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.f;       // > 0: s = softcap * tanh(s / softcap) after scaling (0: off)
  const uint8_t* key_padding = nullptr;  // optional bool (B, Lk), true = padding (ignored key)
  int64_t key_padding_batch_stride = 0, key_padding_key_stride = 0;
};

struct AttentionFwdParams {
  AttentionShape shape;
  HeadsIn q, k, v;  // k and v have kv_heads heads
  HeadsOut out;     // (B, H, Lq, D)
  float* lse = nullptr;  // (B, H, Lq) contiguous, natural log, +inf for rows with no key
};

struct AttentionBwdParams {
  AttentionShape shape;
  HeadsIn q, k, v, out, dout;
  const float* lse = nullptr;  // (B, H, Lq) contiguous, from the forward
  HeadsOut dq, dk, dv;
  float* dq_accum = nullptr;   // workspace (B, H, Lq, D) fp32, zeroed by attention_bwd
  float* delta = nullptr;      // workspace (B, H, Lq) fp32: rowsum(dout * out)
};

// head_dim and dtype values the kernels are compiled for.
bool attention_supported(DType dtype, int head_dim);
cudaError_t attention_fwd(const AttentionFwdParams& p, cudaStream_t stream);
cudaError_t attention_bwd(const AttentionBwdParams& p, cudaStream_t stream);

// ---- FFN epilogues (ffn_epilogue.cu) ------------------------------------------------------------
// Elementwise kernels on a (rows, cols) GEMM output; every matrix is addressed as
// ptr[row * row_stride + col] (last dim contiguous); math in fp32, see common/activations.h.

// y = act(x + bias)
struct BiasActFwdParams {
  DType dtype = DType::f32, bias_dtype = DType::f32;
  Activation act = Activation::relu;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;    int64_t x_row_stride = 0;
  const void* bias = nullptr; // optional (cols,)
  void* y = nullptr;          int64_t y_row_stride = 0;
};

// dx = dy * act'(x + bias); dbias = sum over rows of dx (fp32, in row-group order)
struct BiasActBwdParams {
  DType dtype = DType::f32, bias_dtype = DType::f32;
  Activation act = Activation::relu;
  int64_t rows = 0, cols = 0;
  const void* dy = nullptr;   int64_t dy_row_stride = 0;
  const void* x = nullptr;    int64_t x_row_stride = 0;
  const void* bias = nullptr; // optional (cols,)
  void* dx = nullptr;         int64_t dx_row_stride = 0;
  float* dbias_part = nullptr;  // (row_groups, cols) scratch, needed with dbias
  void* dbias = nullptr;        // optional (cols,), bias_dtype
  int row_groups = 1;           // see bias_act_bwd_row_groups()
};

// h = act(gate) * up
struct GatedActFwdParams {
  DType dtype = DType::f32;
  Activation act = Activation::silu;
  int64_t rows = 0, cols = 0;
  const void* gate = nullptr; int64_t gate_row_stride = 0;
  const void* up = nullptr;   int64_t up_row_stride = 0;
  void* h = nullptr;          int64_t h_row_stride = 0;
};

// dgate = dh * up * act'(gate), dup = dh * act(gate)
struct GatedActBwdParams {
  DType dtype = DType::f32;
  Activation act = Activation::silu;
  int64_t rows = 0, cols = 0;
  const void* dh = nullptr;   int64_t dh_row_stride = 0;
  const void* gate = nullptr; int64_t gate_row_stride = 0;
  const void* up = nullptr;   int64_t up_row_stride = 0;
  void* dgate = nullptr;      int64_t dgate_row_stride = 0;
  void* dup = nullptr;        int64_t dup_row_stride = 0;
};

int bias_act_bwd_row_groups(int64_t rows, int64_t cols, int sm_count);
cudaError_t bias_act_fwd(const BiasActFwdParams& p, cudaStream_t stream);
cudaError_t bias_act_bwd(const BiasActBwdParams& p, cudaStream_t stream);
cudaError_t gated_act_fwd(const GatedActFwdParams& p, cudaStream_t stream);
cudaError_t gated_act_bwd(const GatedActBwdParams& p, cudaStream_t stream);

}  // namespace fastformer::cuda
