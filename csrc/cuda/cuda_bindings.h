// Torch-side glue for the CUDA launchers, included by csrc/bindings.cpp only when built with
// CUDA (FASTFORMER_WITH_CUDA): the _C.cuda_* functions. Allocates outputs, reads strides,
// passes the current stream. CUDA tensors only (csrc/cpu/cpu_bindings.h is the CPU twin).
// The Python layer guarantees the preconditions checked here (uniform row strides, dtypes, the
// options the Impls in fastformer/ops/*.py declare).
//
// Entry points (namespace fastformer::cuda_bindings):
//   add_norm_fwd(x, residual, weight, bias, NormOptions) / add_norm_bwd   as the CPU ones
//   attention_fwd(q, k, v, AttentionOptions)
//       -> {out (B, H, Lq, D) stored as (B, Lq, H, D), lse (B, H, Lq) fp32}
//   attention_bwd(dout, q, k, v, out, lse, AttentionOptions) -> {dq, dk, dv}
//       fp16/bf16, head dim 64 or 128; options: scale, causal (both alignments),
//       key_padding_mask, window_left / window_right and softcap only (the Impl declares no
//       other; the rest are checked absent); q, k, v, dout, out: 4-D, last dim contiguous,
//       any other strides.
//   ffn_bias_act_fwd(x, bias, activation) -> y = act(x + bias)
//   ffn_bias_act_bwd(dy, x, bias, activation, need_dbias) -> {dx, dbias}
//       dx = dy * act'(x + bias); dbias = dx summed over rows (bias's dtype, x's if no bias),
//       an empty tensor unless need_dbias
//   ffn_gated_act_fwd(gate, up, activation) -> h = act(gate) * up
//   ffn_gated_act_bwd(dh, gate, up, activation) -> {dgate, dup}
//       dgate = dh * up * act'(gate), dup = dh * act(gate)
//   FFN epilogues: fp32/fp16/bf16, (..., N) tensors whose rows have one stride (last dim
//   contiguous), bias (N,); outputs contiguous in x's (gate's) shape and dtype; activation is
//   the Activation code of common/activations.h: 0 relu, 1 gelu (erf), 2 gelu_tanh, 3 silu,
//   4 quick_gelu, 5 relu2.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/cuda_kernels.h"
#include "options.h"

namespace fastformer::cuda_bindings {

using namespace fastformer::cuda;  // the launchers' parameter structs and helpers


inline DType cuda_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    default: TORCH_CHECK(false, "fastformer CUDA kernels: unsupported dtype ", t.scalar_type());
  }
}

// Stride between rows of t viewed as (-1, t.size(-1)); the leading dims must collapse.
inline int64_t uniform_row_stride(const at::Tensor& t) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1 || t.numel() == 0,
              "fastformer CUDA: last dim must be contiguous");
  int64_t stride = -1, expected = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
    } else {
      TORCH_CHECK(t.stride(d) == expected, "fastformer CUDA: rows must have one stride");
    }
    expected = t.stride(d) * t.size(d);
  }
  return stride < 0 ? t.size(-1) : stride;
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

inline std::vector<at::Tensor> add_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const c10::optional<at::Tensor>& weight,
                                            const c10::optional<at::Tensor>& bias,
                                            const NormOptions& o) {
  const bool rms = o.rms, return_residual = o.return_residual;
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor res_out = (return_residual && has_res) ? at::empty_like(y) : at::empty({0}, x.options());
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rms ? 0 : rows}, f32);
  at::Tensor rstd = at::empty({rows}, f32);
  NormFwdParams p;
  p.dtype = cuda_dtype(x);
  p.param_dtype = weight.has_value() ? cuda_dtype(*weight) : (bias.has_value() ? cuda_dtype(*bias) : p.dtype);
  p.rows = rows;
  p.hidden = hidden;
  p.eps = static_cast<float>(o.eps);
  p.rms = rms;
  p.x = x.data_ptr();
  p.x_row_stride = uniform_row_stride(x);
  if (has_res) {
    p.residual = residual->data_ptr();
    p.residual_row_stride = uniform_row_stride(*residual);
  }
  p.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.residual_out = res_out.numel() ? res_out.data_ptr() : nullptr;
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  check_launch(cuda::add_norm_fwd(p, c10::cuda::getCurrentCUDAStream().stream()), "add_norm_fwd");
  return {y, res_out, mean, rstd};
}

inline std::vector<at::Tensor> add_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dres,
                                            const at::Tensor& z_a, const c10::optional<at::Tensor>& z_b,
                                            const c10::optional<at::Tensor>& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                                            bool need_dweight, bool need_dbias, int64_t param_dtype_code) {
  c10::cuda::CUDAGuard guard(dy.device());
  const int64_t hidden = z_a.size(-1);
  const int64_t rows = hidden == 0 ? 0 : z_a.numel() / hidden;
  const DType param_dtype = static_cast<DType>(param_dtype_code);
  const at::ScalarType param_st = param_dtype == DType::f16 ? at::kHalf
                                  : param_dtype == DType::bf16 ? at::kBFloat16 : at::kFloat;
  at::Tensor dz = at::empty(z_a.sizes(), z_a.options().memory_format(at::MemoryFormat::Contiguous));
  auto p_opts = z_a.options().dtype(param_st);
  at::Tensor dweight = at::empty({need_dweight ? hidden : 0}, p_opts);
  at::Tensor dbias = at::empty({need_dbias ? hidden : 0}, p_opts);
  int sm_count = 0;
  check_launch(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dy.get_device()),
               "cudaDeviceGetAttribute");
  const int blocks = norm_bwd_blocks(rows, sm_count);
  auto f32 = z_a.options().dtype(at::kFloat);
  at::Tensor dw_part = at::empty({need_dweight ? blocks * hidden : 0}, f32);
  at::Tensor db_part = at::empty({need_dbias ? blocks * hidden : 0}, f32);

  NormBwdParams p;
  p.dtype = cuda_dtype(z_a);
  p.param_dtype = param_dtype;
  p.rows = rows;
  p.hidden = hidden;
  p.rms = rms;
  p.dy = dy.data_ptr();
  p.dy_row_stride = uniform_row_stride(dy);
  if (dres.has_value() && dres->defined()) {
    p.dres = dres->data_ptr();
    p.dres_row_stride = uniform_row_stride(*dres);
  }
  p.z_a = z_a.data_ptr();
  p.z_a_row_stride = uniform_row_stride(z_a);
  if (z_b.has_value() && z_b->defined()) {
    p.z_b = z_b->data_ptr();
    p.z_b_row_stride = uniform_row_stride(*z_b);
  }
  p.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.dz = dz.data_ptr();
  p.dw_part = need_dweight ? dw_part.data_ptr<float>() : nullptr;
  p.db_part = need_dbias ? db_part.data_ptr<float>() : nullptr;
  p.dweight = need_dweight ? dweight.data_ptr() : nullptr;
  p.dbias = need_dbias ? dbias.data_ptr() : nullptr;
  p.num_blocks = blocks;
  check_launch(cuda::add_norm_bwd(p, c10::cuda::getCurrentCUDAStream().stream()), "add_norm_bwd");
  return {dz, dweight, dbias};
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---- attention ------------------------------------------------------------------------------
// The kernels copy 16-byte chunks: data 16-byte aligned and the (batch, head, row) strides
// multiples of 8 elements. A view that is not (an odd slice offset: never on the hot path of
// a model) is copied once.
inline at::Tensor attention_aligned(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "fastformer CUDA attention: expected a 4-D tensor");
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1,
              "fastformer CUDA attention: last dim must be contiguous");
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d < 3; ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

inline HeadsIn heads_in(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}
inline HeadsOut heads_out(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// q, k, v aligned for the kernels and the call's shape (sizes, scale, causal, window, softcap,
// key padding).
struct AttentionCall {
  at::Tensor q, k, v;
  AttentionShape shape;
};

inline AttentionCall attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const AttentionOptions& o) {
  TORCH_CHECK(!present(o.attn_mask), "fastformer CUDA attention: attn_mask is not supported");
  TORCH_CHECK(o.dropout_p == 0.0, "fastformer CUDA attention: dropout is not supported");
  TORCH_CHECK(!present(o.alibi_slopes), "fastformer CUDA attention: alibi_slopes is not supported");
  TORCH_CHECK(!present(o.sinks), "fastformer CUDA attention: sinks is not supported");
  TORCH_CHECK(!present(o.rel_bias), "fastformer CUDA attention: position_bias (rel_bias) is not supported");
  TORCH_CHECK(o.causal >= 0 && o.causal <= 2, "fastformer CUDA attention: causal must be 0, 1 or 2");
  TORCH_CHECK(o.window_left >= -1 && o.window_right >= -1,
              "fastformer CUDA attention: window sides must be >= 0 or -1 (no limit), got (",
              o.window_left, ", ", o.window_right, ")");
  TORCH_CHECK(std::isfinite(o.softcap) && o.softcap >= 0.0,
              "fastformer CUDA attention: softcap must be finite and > 0 (0: off), got ", o.softcap);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "fastformer CUDA attention: q, k, v must share a dtype");
  AttentionCall c{attention_aligned(q), attention_aligned(k), attention_aligned(v), {}};
  AttentionShape& s = c.shape;
  s.dtype = cuda_dtype(q);
  s.head_dim = static_cast<int>(q.size(3));
  TORCH_CHECK(attention_supported(s.dtype, s.head_dim),
              "fastformer CUDA attention: fp16/bf16 with head dim 64 or 128 only");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3),
              "fastformer CUDA attention: head dims differ");
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch && v.size(1) == s.kv_heads &&
                  v.size(2) == k.size(2),
              "fastformer CUDA attention: k and v shapes do not match q");
  TORCH_CHECK(s.kv_heads > 0 ? s.heads % s.kv_heads == 0 : s.heads == 0,
              "fastformer CUDA attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) < (int64_t{1} << 31) && k.size(2) < (int64_t{1} << 31),
              "fastformer CUDA attention: sequence too long");
  s.len_q = static_cast<int>(q.size(2));
  s.len_k = static_cast<int>(k.size(2));
  s.scale = static_cast<float>(o.scale.value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  s.causal = static_cast<int>(o.causal);
  s.window_left = o.window_left;
  s.window_right = o.window_right;
  s.softcap = static_cast<float>(o.softcap);
  TORCH_CHECK(o.softcap == 0.0 || (s.softcap >= std::numeric_limits<float>::min() &&
                                    std::isfinite(s.softcap)),
              "fastformer CUDA attention: softcap ", o.softcap, " is outside fp32's normal range");
  if (const at::Tensor* m = present(o.key_padding_mask)) {
    TORCH_CHECK(m->scalar_type() == at::kBool && m->dim() == 2 && m->size(0) == s.batch &&
                    m->size(1) == s.len_k && m->device() == q.device(),
                "fastformer CUDA attention: key_padding_mask must be bool (B, Lk) on q's device");
    s.key_padding = reinterpret_cast<const uint8_t*>(m->data_ptr<bool>());
    s.key_padding_batch_stride = m->stride(0);
    s.key_padding_key_stride = m->stride(1);
  }
  return c;
}

inline std::vector<at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const AttentionOptions& o) {
  c10::cuda::CUDAGuard guard(q.device());
  const AttentionCall c = attention_call(q, k, v, o);
  const AttentionShape& s = c.shape;
  AttentionFwdParams p;
  p.shape = s;
  // (B, H, Lq, D) stored as (B, Lq, H, D): the head merge that follows is a free reshape
  at::Tensor out = at::empty({s.batch, s.len_q, s.heads, s.head_dim}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  p.q = heads_in(c.q);
  p.k = heads_in(c.k);
  p.v = heads_in(c.v);
  p.out = heads_out(out);
  p.lse = lse.data_ptr<float>();
  check_launch(cuda::attention_fwd(p, current_stream()), "attention_fwd");
  return {out, lse};
}

inline std::vector<at::Tensor> attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& lse,
                                             const AttentionOptions& o) {
  c10::cuda::CUDAGuard guard(q.device());
  const AttentionCall c = attention_call(q, k, v, o);
  const AttentionShape& s = c.shape;
  AttentionBwdParams p;
  p.shape = s;
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == s.batch * s.heads * s.len_q,
              "fastformer CUDA attention: lse must be the forward's fp32 (B, H, Lq)");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "fastformer CUDA attention: dout and out must match q");
  const at::Tensor dout_a = attention_aligned(dout), out_a = attention_aligned(out);
  const at::Tensor lse_c = lse.contiguous();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::empty({s.batch, s.heads, s.len_q, s.head_dim}, f32);
  at::Tensor delta = at::empty({s.batch, s.heads, s.len_q}, f32);
  p.q = heads_in(c.q);
  p.k = heads_in(c.k);
  p.v = heads_in(c.v);
  p.out = heads_in(out_a);
  p.dout = heads_in(dout_a);
  p.lse = lse_c.data_ptr<float>();
  p.dq = heads_out(dq);
  p.dk = heads_out(dk);
  p.dv = heads_out(dv);
  p.dq_accum = dq_accum.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  check_launch(cuda::attention_bwd(p, current_stream()), "attention_bwd");
  return {dq, dk, dv};
}

// ---- FFN epilogues --------------------------------------------------------------------------
inline Activation ffn_activation(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 5, "fastformer CUDA FFN: activation code must be 0..5, got ",
              code);
  return static_cast<Activation>(code);
}

// (rows, cols) of t viewed as (-1, t.size(-1)).
inline std::pair<int64_t, int64_t> rows_cols(const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "fastformer CUDA FFN: expected at least 1 dim");
  const int64_t cols = t.size(-1);
  return {cols ? t.numel() / cols : 0, cols};
}

inline at::Tensor empty_rows_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

inline void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (!bias.has_value() || !bias->defined()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(-1) && bias->is_contiguous() &&
                  bias->device() == x.device(),
              "fastformer CUDA FFN: bias must be a contiguous (N,) tensor on x's device");
}

inline at::Tensor ffn_bias_act_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                   int64_t activation) {
  c10::cuda::CUDAGuard guard(x.device());
  check_bias(bias, x);
  at::Tensor y = empty_rows_like(x);
  BiasActFwdParams p;
  p.dtype = cuda_dtype(x);
  p.act = ffn_activation(activation);
  std::tie(p.rows, p.cols) = rows_cols(x);
  p.x = x.data_ptr();
  p.x_row_stride = uniform_row_stride(x);
  if (bias.has_value() && bias->defined()) {
    p.bias = bias->data_ptr();
    p.bias_dtype = cuda_dtype(*bias);
  }
  p.y = y.data_ptr();
  p.y_row_stride = p.cols;
  check_launch(cuda::bias_act_fwd(p, current_stream()), "ffn_bias_act_fwd");
  return y;
}

inline std::vector<at::Tensor> ffn_bias_act_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const c10::optional<at::Tensor>& bias,
                                                int64_t activation, bool need_dbias) {
  c10::cuda::CUDAGuard guard(x.device());
  check_bias(bias, x);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "fastformer CUDA FFN: dy must match x");
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor dx = empty_rows_like(x);
  BiasActBwdParams p;
  p.dtype = cuda_dtype(x);
  p.bias_dtype = has_bias ? cuda_dtype(*bias) : p.dtype;
  p.act = ffn_activation(activation);
  std::tie(p.rows, p.cols) = rows_cols(x);
  p.dy = dy.data_ptr();
  p.dy_row_stride = uniform_row_stride(dy);
  p.x = x.data_ptr();
  p.x_row_stride = uniform_row_stride(x);
  p.bias = has_bias ? bias->data_ptr() : nullptr;
  p.dx = dx.data_ptr();
  p.dx_row_stride = p.cols;
  at::Tensor dbias = at::empty({need_dbias ? p.cols : 0}, has_bias ? bias->options() : x.options());
  at::Tensor part;
  if (need_dbias) {
    int sm_count = 0;
    check_launch(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, x.get_device()),
                 "cudaDeviceGetAttribute");
    p.row_groups = bias_act_bwd_row_groups(p.rows, p.cols, sm_count);
    part = at::empty({p.row_groups, p.cols}, x.options().dtype(at::kFloat));
    p.dbias_part = part.data_ptr<float>();
    p.dbias = dbias.data_ptr();
  }
  check_launch(cuda::bias_act_bwd(p, current_stream()), "ffn_bias_act_bwd");
  return {dx, dbias};
}

inline at::Tensor ffn_gated_act_fwd(const at::Tensor& gate, const at::Tensor& up,
                                    int64_t activation) {
  c10::cuda::CUDAGuard guard(gate.device());
  TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "fastformer CUDA FFN: gate and up must match");
  at::Tensor h = empty_rows_like(gate);
  GatedActFwdParams p;
  p.dtype = cuda_dtype(gate);
  p.act = ffn_activation(activation);
  std::tie(p.rows, p.cols) = rows_cols(gate);
  p.gate = gate.data_ptr();
  p.gate_row_stride = uniform_row_stride(gate);
  p.up = up.data_ptr();
  p.up_row_stride = uniform_row_stride(up);
  p.h = h.data_ptr();
  p.h_row_stride = p.cols;
  check_launch(cuda::gated_act_fwd(p, current_stream()), "ffn_gated_act_fwd");
  return h;
}

inline std::vector<at::Tensor> ffn_gated_act_bwd(const at::Tensor& dh, const at::Tensor& gate,
                                                 const at::Tensor& up, int64_t activation) {
  c10::cuda::CUDAGuard guard(gate.device());
  TORCH_CHECK(up.sizes() == gate.sizes() && dh.sizes() == gate.sizes() &&
                  up.scalar_type() == gate.scalar_type() && dh.scalar_type() == gate.scalar_type(),
              "fastformer CUDA FFN: dh, gate and up must match");
  at::Tensor dgate = empty_rows_like(gate), dup = empty_rows_like(gate);
  GatedActBwdParams p;
  p.dtype = cuda_dtype(gate);
  p.act = ffn_activation(activation);
  std::tie(p.rows, p.cols) = rows_cols(gate);
  p.dh = dh.data_ptr();
  p.dh_row_stride = uniform_row_stride(dh);
  p.gate = gate.data_ptr();
  p.gate_row_stride = uniform_row_stride(gate);
  p.up = up.data_ptr();
  p.up_row_stride = uniform_row_stride(up);
  p.dgate = dgate.data_ptr();
  p.dgate_row_stride = p.cols;
  p.dup = dup.data_ptr();
  p.dup_row_stride = p.cols;
  check_launch(cuda::gated_act_bwd(p, current_stream()), "ffn_gated_act_bwd");
  return {dgate, dup};
}

}  // namespace fastformer::cuda_bindings
