// Torch-side glue of the CPU kernels, included by csrc/bindings.cpp: turns tensors and the
// option structs (csrc/options.h) into the raw pointer / size / stride argument structs of
// csrc/cpu/cpu_kernels.h, allocates outputs, releases the GIL and calls the kernel table
// selected for the running CPU (kernels(), bindings.cpp). CPU tensors only: the Python
// selection (fastformer/backends.py) decides the backend; csrc/cuda/cuda_bindings.h is the
// CUDA twin.
//
// User-facing validation (ValueError/TypeError naming the argument) happens in Python
// (fastformer/_checks.py); the TORCH_CHECKs here guard the kernels' own preconditions, which the
// Python layer guarantees, so a failure here is a fastformer bug, not a user error.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <optional>

#include "cpu/cpu_kernels.h"
#include "options.h"

namespace fastformer {
namespace cpu {
const KernelTable& kernels();  // the table of the selected capability level (bindings.cpp)
}  // namespace cpu

namespace cpu_bindings {

namespace py = pybind11;
using at::Tensor;
using std::optional;

inline DType to_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "fastformer._C: unsupported dtype ", t.scalar_type());
  }
}

inline at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::f32: return at::kFloat;
    case DType::f64: return at::kDouble;
    case DType::bf16: return at::kBFloat16;
    case DType::f16: return at::kHalf;
  }
  return at::kFloat;
}

inline void check_cpu(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fastformer._C.", what, ": expected CPU tensors (the cuda_* "
              "functions take CUDA tensors)");
}

// Rows of a tensor viewed as (rows, last_dim): coalesce leading dims where possible. Any
// strides (row_layout() below requires a contiguous last dim).
inline cpu::RowLayout leading_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "fastformer._C: expected at least one dimension");
  cpu::RowLayout layout;
  int64_t sizes[64], strides[64];
  int n = 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 1) continue;  // size-1 dims never move the pointer
    if (n > 0 && strides[n - 1] == t.stride(d) * t.size(d)) {
      sizes[n - 1] *= t.size(d);
      strides[n - 1] = t.stride(d);
    } else {
      sizes[n] = t.size(d);
      strides[n] = t.stride(d);
      ++n;
    }
  }
  if (n == 0) {
    layout.ndim = 1;
    layout.sizes[0] = 1;
    layout.strides[0] = 0;
    return layout;
  }
  TORCH_CHECK(n <= cpu::kMaxDims, "fastformer._C: too many non-mergeable leading dims");
  layout.ndim = n;
  for (int i = 0; i < n; ++i) {
    layout.sizes[i] = sizes[i];
    layout.strides[i] = strides[i];
  }
  return layout;
}

inline cpu::RowLayout row_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1 && (t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0),
              "fastformer._C: last dimension must be contiguous");
  return leading_layout(t);
}

inline const void* ptr_or_null(const optional<Tensor>& t) {
  const Tensor* p = present(t);
  return p ? p->data_ptr() : nullptr;
}

inline at::ScalarType stats_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A tensor laid out as a contiguous copy of `shape` would be, in x's options.
inline Tensor empty_rows(at::IntArrayRef shape, const Tensor& like) {
  return at::empty(shape, like.options().memory_format(at::MemoryFormat::Contiguous));
}

// Releases the GIL around a kernel when this thread holds it: a call from Python does, the
// autograd engine running a C++ node's backward (AddNormFunction) does not.
class KernelGilRelease {
 public:
  KernelGilRelease() {
    if (PyGILState_Check()) release_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

// ---- add + norm -----------------------------------------------------------------------------
inline std::vector<Tensor> add_norm_fwd(const Tensor& x, const optional<Tensor>& residual,
                                        const optional<Tensor>& weight, const optional<Tensor>& bias,
                                        const NormOptions& o) {
  check_cpu(x, "add_norm_fwd");
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const Tensor* res = present(residual);
  Tensor y = empty_rows(x.sizes(), x);
  Tensor res_out = (o.return_residual && res) ? at::empty_like(y) : at::empty({0}, x.options());
  auto stat_opts = x.options().dtype(stats_dtype(x));
  Tensor mean = o.rms ? at::empty({0}, stat_opts) : at::empty({rows}, stat_opts);
  Tensor rstd = at::empty({rows}, stat_opts);

  cpu::NormFwdArgs a;
  a.dtype = to_dtype(x);
  a.param_dtype = weight.has_value() ? to_dtype(*weight) : (bias.has_value() ? to_dtype(*bias) : a.dtype);
  a.rows = rows;
  a.hidden = hidden;
  a.eps = o.eps;
  a.rms = o.rms;
  a.x = x.data_ptr();
  a.x_rows = row_layout(x);
  if (res) {
    a.residual = res->data_ptr();
    a.residual_rows = row_layout(*res);
  }
  a.weight = ptr_or_null(weight);
  a.bias = ptr_or_null(bias);
  a.y = y.data_ptr();
  a.residual_out = res_out.numel() ? res_out.data_ptr() : nullptr;
  a.mean = o.rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  if (rows > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().add_norm_fwd(a);
  }
  return {y, res_out, mean, rstd};
}

inline std::vector<Tensor> add_norm_bwd(const Tensor& dy, const optional<Tensor>& dresidual_out,
                                        const Tensor& z_a, const optional<Tensor>& z_b,
                                        const optional<Tensor>& weight, const Tensor& mean,
                                        const Tensor& rstd, bool rms, bool need_dweight,
                                        bool need_dbias, int64_t param_dtype_code) {
  check_cpu(dy, "add_norm_bwd");
  const int64_t hidden = z_a.size(-1);
  const int64_t rows = hidden == 0 ? 0 : z_a.numel() / hidden;
  const DType param_dtype = static_cast<DType>(param_dtype_code);
  Tensor dz = empty_rows(z_a.sizes(), z_a);
  auto p_opts = z_a.options().dtype(to_scalar_type(param_dtype));
  Tensor dweight = need_dweight ? at::empty({hidden}, p_opts) : at::empty({0}, p_opts);
  Tensor dbias = need_dbias ? at::empty({hidden}, p_opts) : at::empty({0}, p_opts);

  cpu::NormBwdArgs a;
  a.dtype = to_dtype(z_a);
  a.param_dtype = param_dtype;
  a.rows = rows;
  a.hidden = hidden;
  a.rms = rms;
  a.dy = dy.data_ptr();
  a.dy_rows = row_layout(dy);
  if (const Tensor* d = present(dresidual_out)) {
    a.dresidual_out = d->data_ptr();
    a.dresidual_out_rows = row_layout(*d);
  }
  a.z_a = z_a.data_ptr();
  a.z_a_rows = row_layout(z_a);
  if (const Tensor* b = present(z_b)) {
    a.z_b = b->data_ptr();
    a.z_b_rows = row_layout(*b);
  }
  a.weight = ptr_or_null(weight);
  a.mean = rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  a.dz = dz.data_ptr();
  a.dweight = need_dweight ? dweight.data_ptr() : nullptr;
  a.dbias = need_dbias ? dbias.data_ptr() : nullptr;
  {
    KernelGilRelease no_gil;
    cpu::kernels().add_norm_bwd(a);
  }
  return {dz, dweight, dbias};
}

// A gradient with a contiguous last dim (autograd may hand over an expanded, stride-0 one).
inline Tensor rowwise(const Tensor& t) {
  if (!t.defined() || t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1) return t;
  return t.contiguous();
}

inline optional<Tensor> defined_or_none(const Tensor& t) {
  return t.defined() ? optional<Tensor>(t) : std::nullopt;
}

// add + norm as a C++ autograd node: the eager route of ff.add_layer_norm / layer_norm /
// rms_norm on the cpu backend (ops/norm.py, _Cpu.autograd). Same saved tensors, kernels and
// gradients as the shared autograd.Function (ops/_opdef.py), which the other backends use;
// what it removes is that Function's per-call Python cost, ~0.1-0.2 ms per forward+backward on
// a 2-core VM: as much as the kernels themselves at (512, 768).
struct AddNormFunction : public torch::autograd::Function<AddNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, Tensor x,
                                                optional<Tensor> residual, optional<Tensor> weight,
                                                optional<Tensor> bias, NormOptions o) {
    std::vector<Tensor> out = add_norm_fwd(x, residual, weight, bias, o);
    const bool has_res = present(residual) != nullptr;
    const bool keeps_res_out = has_res && o.return_residual;
    // z = x + residual is recomputed from what the caller keeps anyway: the returned residual
    // stream, else x and residual.
    const Tensor z_a = keeps_res_out ? out[1] : x;
    const Tensor z_b = (has_res && !keeps_res_out) ? *residual : Tensor();
    const Tensor w = weight.has_value() ? *weight : Tensor();
    ctx->save_for_backward({z_a, z_b, w, out[2], out[3]});
    const bool has_bias = present(bias) != nullptr;
    const Tensor& params = w.defined() ? w : (has_bias ? *bias : x);
    ctx->saved_data["rms"] = o.rms;
    ctx->saved_data["has_res"] = has_res;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["keeps_res_out"] = keeps_res_out;
    ctx->saved_data["param_dtype"] = static_cast<int64_t>(to_dtype(params));
    return {out[0], out[1]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &z_a = saved[0], &z_b = saved[1], &weight = saved[2];
    const bool has_res = ctx->saved_data["has_res"].toBool();
    // needs_input_grad counts tensor inputs only (absent optional ones have no edge).
    const int64_t weight_edge = has_res ? 2 : 1;
    const int64_t bias_edge = weight_edge + (weight.defined() ? 1 : 0);
    const bool need_dw = weight.defined() && ctx->needs_input_grad(weight_edge);
    const bool need_db = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(bias_edge);
    Tensor dres_out = grads[1];
    if (dres_out.defined() && (!ctx->saved_data["keeps_res_out"].toBool() || dres_out.numel() == 0))
      dres_out = Tensor();
    std::vector<Tensor> g = add_norm_bwd(
        rowwise(grads[0]), defined_or_none(rowwise(dres_out)), z_a, defined_or_none(z_b),
        defined_or_none(weight), saved[3], saved[4], ctx->saved_data["rms"].toBool(), need_dw,
        need_db, ctx->saved_data["param_dtype"].toInt());
    return {g[0], has_res ? g[0] : Tensor(), need_dw ? g[1] : Tensor(),
            need_db ? g[2] : Tensor(), Tensor()};
  }
};

inline std::vector<Tensor> add_norm_autograd(const Tensor& x, const optional<Tensor>& residual,
                                             const optional<Tensor>& weight,
                                             const optional<Tensor>& bias, const NormOptions& o) {
  return AddNormFunction::apply(x, residual, weight, bias, o);
}

// ---- attention --------------------------------------------------------------------------------
inline cpu::View4 view4(const Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "fastformer._C: expected a 4-D tensor");
  cpu::View4 v;
  v.ptr = t.data_ptr();
  for (int i = 0; i < 4; ++i) v.s[i] = t.stride(i);
  return v;
}

// Packed sequences (cu_seqlens_q): the (total, H, D) tensors as the kernels' (1, H, total, D)
// views; other calls' tensors as they are.
inline Tensor heads_view(const Tensor& t, const AttentionOptions& o) {
  return present(o.cu_seqlens_q) ? t.unsqueeze(0).transpose(1, 2) : t;
}

inline const int32_t* int32_vector(const Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() && t.numel() == n,
              "fastformer._C: ", what, " must be a contiguous int32 vector of ", n, " entries");
  return t.data_ptr<int32_t>();
}

// The variable lengths of a call (ops/varlen.py): packed sequences or a KV cache (its rows'
// key counts, its pages). The Python side validated the values.
inline void attn_lengths(cpu::AttnArgs& a, const Tensor& k, const AttentionOptions& o) {
  const bool masked = present(o.attn_mask) || present(o.key_padding_mask) || present(o.rel_bias);
  if (const Tensor* cu_q = present(o.cu_seqlens_q)) {
    const Tensor* cu_k = present(o.cu_seqlens_k);
    TORCH_CHECK(cu_k && !masked && a.B == 1, "fastformer._C: packed sequences need cu_seqlens_k "
                "and take no attention mask, key padding mask or relative bias");
    a.n_seqs = cu_q->numel() - 1;
    a.cu_q = int32_vector(*cu_q, a.n_seqs + 1, "cu_seqlens_q");
    a.cu_k = int32_vector(*cu_k, a.n_seqs + 1, "cu_seqlens_k");
    TORCH_CHECK(a.cu_q[a.n_seqs] == a.Lq && a.cu_k[a.n_seqs] == a.Lk,
                "fastformer._C: cu_seqlens must end at the packed lengths");
  }
  if (const Tensor* lens = present(o.seqlens_k)) {
    TORCH_CHECK(!masked && a.dropout_p == 0.0, "fastformer._C: KV-cache calls take no masks, "
                "relative bias or dropout");
    a.k_lens = int32_vector(*lens, a.B, "seqlens_k");
    const Tensor* table = present(o.block_table);
    if (table) {
      TORCH_CHECK(table->scalar_type() == at::kInt && table->dim() == 2 && table->size(0) == a.B &&
                      table->stride(1) == 1,
                  "fastformer._C: block_table must be int32 (B, max_blocks) with unit column stride");
      a.block_table = table->data_ptr<int32_t>();
      a.bt_stride = table->stride(0);
      a.block_size = k.size(2);
    }
    const int64_t capacity = table ? table->size(1) * a.block_size : k.size(2);
    a.Lk = 0;  // the longest row (sizes the splits and the work estimate)
    for (int64_t b = 0; b < a.B; ++b) {
      TORCH_CHECK(a.k_lens[b] >= 0 && a.k_lens[b] <= capacity, "fastformer._C: seqlens_k[", b,
                  "] = ", a.k_lens[b], " is outside the cache's ", capacity, " rows");
      a.Lk = std::max<int64_t>(a.Lk, a.k_lens[b]);
    }
  } else {
    TORCH_CHECK(!present(o.block_table), "fastformer._C: block_table needs seqlens_k");
  }
}

// The kernels' arguments of a call: sizes and views of q, k, v and every option (q, k, v as
// the kernels see them: heads_view).
inline cpu::AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v,
                               const AttentionOptions& o) {
  check_cpu(q, "attention");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->size(3) <= 1 || t->stride(3) == 1, "fastformer._C: last dim must be contiguous");
  cpu::AttnArgs a;
  a.dtype = to_dtype(q);
  a.B = q.size(0); a.H = q.size(1); a.Lq = q.size(2); a.D = q.size(3);
  a.Hkv = k.size(1); a.Lk = k.size(2); a.Dv = v.size(3);
  a.q = view4(q); a.k = view4(k); a.v = view4(v);
  if (const Tensor* m = present(o.attn_mask)) {
    a.attn_mask = view4(m->expand({a.B, a.H, a.Lq, a.Lk}));  // a view (stride 0 where it broadcasts)
    a.mask_is_bool = m->scalar_type() == at::kBool;
    if (!a.mask_is_bool) a.mask_dtype = to_dtype(*m);
  }
  if (const Tensor* kpm = present(o.key_padding_mask)) {
    a.key_padding_mask = kpm->data_ptr<bool>();
    a.kpm_s[0] = kpm->stride(0);
    a.kpm_s[1] = kpm->stride(1);
  }
  a.causal = static_cast<int32_t>(o.causal);
  a.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(a.D)));
  a.dropout_p = o.dropout_p;
  std::tie(a.seed, a.offset) = seed_offset(o.rng_state);
  a.window_left = o.window_left;
  a.window_right = o.window_right;
  a.softcap = o.softcap;
  const at::ScalarType acc = stats_dtype(q);
  if (const Tensor* s = present(o.alibi_slopes)) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && (s->dim() == 1 || s->dim() == 2),
                "fastformer._C: alibi_slopes must be fp32 (H,) or (B, H)");
    a.alibi_slopes = s->data_ptr<float>();
    a.alibi_s[0] = s->dim() == 2 ? s->stride(0) : 0;
    a.alibi_s[1] = s->stride(-1);
  }
  if (const Tensor* s = present(o.sinks)) {
    TORCH_CHECK(s->scalar_type() == acc && s->is_contiguous() && s->numel() == a.H,
                "fastformer._C: sinks must be (H,) contiguous in the accumulation dtype");
    a.sinks = s->data_ptr();
  }
  attn_lengths(a, k, o);
  if (const Tensor* s = present(o.alibi_slopes); s && a.cu_q)
    TORCH_CHECK(s->dim() == 1 || s->size(0) == a.n_seqs, "fastformer._C: alibi_slopes must be (H,) or (S, H)");
  return a;
}

// Columns of padding of the relative bias vector and its gradient (attention_common.h's
// kRelSlack: the kernels read whole vectors past a block's last key).
constexpr int64_t kRelSlack = 64;

// The relative bias of a call, (H, Lq + Lk - 1), copied into rows padded by kRelSlack zero
// columns (small: H * (Lq + Lk) values), or an undefined tensor. The kernels keep a pointer.
inline Tensor padded_rel_bias(const AttentionOptions& o, cpu::AttnArgs& a, const Tensor& q) {
  const Tensor* r = present(o.rel_bias);
  if (!r) return Tensor();
  TORCH_CHECK(r->scalar_type() == stats_dtype(q) && r->dim() == 2 && r->size(0) == a.H &&
                  r->size(1) == a.Lq + a.Lk - 1,
              "fastformer._C: rel_bias must be (H, Lq + Lk - 1) in the accumulation dtype");
  Tensor padded = at::zeros({a.H, a.Lq + a.Lk - 1 + kRelSlack}, r->options());
  padded.narrow(1, 0, a.Lq + a.Lk - 1).copy_(*r);
  a.rel_bias = padded.data_ptr();
  return padded;
}

// Returns {out, lse}: (B, H, Lq, Dv) and (B, H, Lq); packed sequences (total_q, H, Dv) and
// (H, total_q).
inline std::vector<Tensor> attention_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const AttentionOptions& o) {
  const Tensor q = heads_view(q_in, o), k = heads_view(k_in, o), v = heads_view(v_in, o);
  cpu::AttnArgs a = attn_args(q, k, v, o);
  const Tensor rel = padded_rel_bias(o, a, q);
  // (B, H, Lq, Dv) stored as (B, Lq, H, Dv): the head merge that follows is a free reshape.
  Tensor out = at::empty({a.B, a.Lq, a.H, a.Dv}, q.options()).transpose(1, 2);
  Tensor lse = at::empty({a.B, a.H, a.Lq}, q.options().dtype(stats_dtype(q)));
  a.out = view4(out);
  a.lse = lse.data_ptr();
  a.lse_s[0] = a.H * a.Lq;
  a.lse_s[1] = a.Lq;
  if (out.numel() > 0 || lse.numel() > 0) {
    if (a.Lk == 0) {
      out.zero_();
      lse.fill_(std::numeric_limits<double>::infinity());
    } else {
      py::gil_scoped_release no_gil;
      cpu::kernels().attention_fwd(a);
    }
  }
  if (a.cu_q) return {out.transpose(1, 2)[0], lse[0]};
  return {out, lse};
}

// Returns {dq, dk, dv, d attn_mask, d sinks, d rel_bias}; the last three only when asked
// for (need_*), else undefined (None): the mask's gradient in its own shape and dtype (summed
// over the dims it broadcasts), the others in the accumulation dtype.
inline std::vector<Tensor> attention_bwd(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                         const Tensor& v_in, const Tensor& out_in, const Tensor& lse_in,
                                         const AttentionOptions& o, bool need_dmask, bool need_dsinks,
                                         bool need_drel) {
  TORCH_CHECK(!present(o.seqlens_k), "fastformer._C: KV-cache calls are forward only");
  const Tensor q = heads_view(q_in, o), k = heads_view(k_in, o), v = heads_view(v_in, o);
  const Tensor dout = heads_view(dout_in, o), out = heads_view(out_in, o);
  const Tensor lse = present(o.cu_seqlens_q) ? lse_in.unsqueeze(0) : lse_in;  // (H, total_q)
  TORCH_CHECK(lse.is_contiguous(), "fastformer._C: lse must be contiguous");
  TORCH_CHECK(dout.size(3) <= 1 || dout.stride(3) == 1, "fastformer._C: dout last dim must be contiguous");
  cpu::AttnArgs a = attn_args(q, k, v, o);
  const Tensor rel = padded_rel_bias(o, a, q);
  Tensor dq_in = at::empty_like(q_in), dk_in = at::empty_like(k_in), dv_in = at::empty_like(v_in);
  Tensor dq = heads_view(dq_in, o), dk = heads_view(dk_in, o), dv = heads_view(dv_in, o);
  a.out = view4(out);
  a.lse = const_cast<void*>(lse.data_ptr());
  a.lse_s[0] = a.H * a.Lq;
  a.lse_s[1] = a.Lq;
  a.dout = view4(dout);
  a.dq = view4(dq); a.dk = view4(dk); a.dv = view4(dv);
  const auto acc = q.options().dtype(stats_dtype(q));
  Tensor dmask, dsinks, drel;
  const Tensor* mask = present(o.attn_mask);
  if (need_dmask && mask && mask->scalar_type() != at::kBool) {
    // Accumulated in the mask's own shape (left-padded to 4-D): stride 0 on the dims it
    // broadcasts, so that (B, H, Lq, Lk) indices add into it.
    std::vector<int64_t> shape4(4 - mask->dim(), 1);
    for (int64_t s : mask->sizes()) shape4.push_back(s);
    dmask = at::zeros(shape4, acc);
    for (int d = 0; d < 4; ++d) a.dmask_s[d] = shape4[d] == 1 ? 0 : dmask.stride(d);
    a.dmask = dmask.data_ptr();
  }
  if (need_dsinks && a.sinks) {  // parts per batch row (packed: per sequence), summed below
    dsinks = at::zeros({a.cu_q ? a.n_seqs : a.B, a.H}, acc);
    a.dsinks = dsinks.data_ptr();
  }
  if (need_drel && a.rel_bias) {
    drel = at::zeros({a.H, a.Lq + a.Lk - 1 + kRelSlack}, acc);
    a.drel = drel.data_ptr();
  }
  if (a.Lq == 0 || a.Lk == 0) {
    dq.zero_(); dk.zero_(); dv.zero_();
    if (dsinks.defined() && a.Lq > 0) {  // no key: p_sink = 1, d sink = -sum delta = 0 (out = 0)
      dsinks.zero_();
    }
  } else if (q.numel() + k.numel() > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().attention_bwd(a);
  }
  if (dmask.defined()) dmask = dmask.to(mask->scalar_type()).reshape(mask->sizes());
  if (dsinks.defined()) dsinks = dsinks.sum(0);
  // Contiguous, as the op's fake promises (a narrowed view's row stride broke compiled T5
  // training: inductor asserts the strides); (H, Lq + Lk - 1) is small.
  if (drel.defined()) drel = drel.narrow(1, 0, a.Lq + a.Lk - 1).contiguous();
  return {dq_in, dk_in, dv_in, dmask, dsinks, drel};
}

// ---- rotary position embedding ----------------------------------------------------------------
// conj: rotate by -theta (the backward).
inline Tensor rotary(const Tensor& x, const RotaryOptions& o, bool conj) {
  check_cpu(x, "rotary");
  TORCH_CHECK(x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1),
              "fastformer._C.rotary: x must be 4-D with a contiguous last dim");
  const Tensor* cos = present(o.cos);
  const Tensor* sin = present(o.sin);
  TORCH_CHECK(cos && sin && cos->is_contiguous() && sin->is_contiguous() &&
                  cos->sizes() == sin->sizes() && cos->dim() == 2 && cos->size(0) == x.size(2) &&
                  2 * cos->size(1) <= x.size(3) && cos->scalar_type() == stats_dtype(x) &&
                  sin->scalar_type() == stats_dtype(x),
              "fastformer._C.rotary: cos and sin must be contiguous (L, R/2) tables in the "
              "accumulation dtype");
  cpu::RotaryArgs a;
  a.dtype = to_dtype(x);
  a.B = x.size(0); a.H = x.size(1); a.L = x.size(2); a.D = x.size(3);
  a.rot_dim = 2 * cos->size(1);
  // (B, H, L, D) stored as (B, L, H, D), the layout of the projection the heads come from.
  Tensor out = at::empty({a.B, a.L, a.H, a.D}, x.options()).transpose(1, 2);
  a.x = view4(x);
  a.out = view4(out);
  a.cos = cos->data_ptr();
  a.sin = sin->data_ptr();
  a.interleaved = o.interleaved;
  a.conj = conj;
  if (out.numel() > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().rotary(a);
  }
  return out;
}

// ---- feed-forward ---------------------------------------------------------------------------
// (..., cols) tensor as a matrix: rows by leading_layout, any column stride.
inline cpu::MatView matrix_view(const Tensor& t) {
  cpu::MatView v;
  v.ptr = t.data_ptr();
  v.rows = leading_layout(t);
  v.col_stride = t.size(-1) <= 1 ? 1 : t.stride(-1);
  return v;
}

inline cpu::FfnArgs ffn_args(const Tensor& x, const Tensor& w1, const Tensor& w2,
                             const optional<Tensor>& w_up, const FfnOptions& o) {
  check_cpu(x, "ffn");
  TORCH_CHECK(o.activation >= 0 && o.activation <= 3, "fastformer._C ffn: activation code must be 0..3");
  cpu::FfnArgs a;
  a.dtype = to_dtype(x);
  a.activation = static_cast<int32_t>(o.activation);
  a.gated = present(w_up) != nullptr;
  a.d_model = x.size(-1);
  a.tokens = a.d_model == 0 ? 0 : x.numel() / a.d_model;
  a.hidden = w1.size(0);
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == a.d_model && w2.dim() == 2 &&
              w2.size(0) == a.d_model && w2.size(1) == a.hidden,
              "fastformer._C ffn: weight shapes do not match");
  a.dropout_p = o.dropout_p;
  std::tie(a.seed, a.offset) = seed_offset(o.rng_state);
  a.x = matrix_view(x);
  a.w1 = matrix_view(w1);
  a.w2 = matrix_view(w2);
  if (a.gated) a.w_up = matrix_view(*w_up);
  return a;
}

// The pre-activation's layout (FfnArgs::saved): the whole block's (tokens, F) or [gate | up].
inline void set_saved(cpu::FfnArgs& a, const Tensor& pre) {
  a.saved = pre.data_ptr();
  a.saved_up = a.gated ? pre.narrow(1, a.hidden, a.hidden).data_ptr() : nullptr;
  a.saved_ld = pre.size(1);
}

inline void set_d_hidden(cpu::FfnArgs& a, const Tensor& d_pre) {
  a.d_hidden = d_pre.data_ptr();
  a.d_up = a.gated ? d_pre.narrow(1, a.hidden, a.hidden).data_ptr() : nullptr;
  a.d_ld = d_pre.size(1);
}

// Returns {y, saved}: saved is the pre-activation (tokens, hidden) (gated: (tokens, 2 * hidden)
// as [gate | up]) when o.store_preactivation, else empty.
inline std::vector<Tensor> ffn_fwd(const Tensor& x, const Tensor& w1, const optional<Tensor>& b1,
                                   const Tensor& w2, const optional<Tensor>& b2,
                                   const optional<Tensor>& w_up, const optional<Tensor>& b_up,
                                   const FfnOptions& o) {
  cpu::FfnArgs a = ffn_args(x, w1, w2, w_up, o);
  a.b1 = ptr_or_null(b1);
  a.b2 = ptr_or_null(b2);
  a.b_up = a.gated ? ptr_or_null(b_up) : nullptr;
  Tensor y = empty_rows(x.sizes(), x);
  const bool save = o.store_preactivation;
  const int64_t width = a.gated && save ? 2 * a.hidden : a.hidden;
  Tensor hidden = at::empty({a.tokens, width}, x.options());
  a.y = y.data_ptr();
  a.hidden_buf = hidden.data_ptr();
  a.store_preactivation = save;
  if (save) set_saved(a, hidden);
  if (a.tokens > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().ffn_fwd(a);
  }
  return {y, save ? hidden : at::empty({0}, x.options())};
}

// Returns {dx, dw1, db1, dw2, db2, dw_up, db_up}; those not asked for are empty.
inline std::vector<Tensor> ffn_bwd(const Tensor& dy, const Tensor& x, const Tensor& w1,
                                   const Tensor& w2, const optional<Tensor>& w_up,
                                   const Tensor& saved, const FfnOptions& o, bool need_dx,
                                   bool need_dw1, bool need_db1, bool need_dw2, bool need_db2,
                                   bool need_dw_up, bool need_db_up) {
  cpu::FfnArgs a = ffn_args(x, w1, w2, w_up, o);
  TORCH_CHECK(dy.sizes() == x.sizes(), "fastformer._C.ffn_bwd: dy must have x's shape");
  TORCH_CHECK(saved.is_contiguous() && saved.numel() == a.tokens * a.hidden * (a.gated ? 2 : 1),
              "fastformer._C.ffn_bwd: saved must be the forward's contiguous pre-activation");
  const auto opts = x.options();
  auto maybe = [&](bool need, at::IntArrayRef shape) {
    return need ? at::empty(shape, opts) : at::empty({0}, opts);
  };
  const int64_t D = a.d_model, F = a.hidden;
  Tensor dx = need_dx ? empty_rows(x.sizes(), x) : at::empty({0}, opts);
  Tensor dw1 = maybe(need_dw1, {F, D}), db1 = maybe(need_db1, {F});
  Tensor dw2 = maybe(need_dw2, {D, F}), db2 = maybe(need_db2, {D});
  Tensor dw_up = maybe(a.gated && need_dw_up, {F, D}), db_up = maybe(a.gated && need_db_up, {F});
  const bool need_hidden = need_dx || need_dw1 || need_db1 || (a.gated && (need_dw_up || need_db_up));
  Tensor d_hidden = maybe(need_hidden, {a.tokens, a.gated ? 2 * F : F});
  a.dy = matrix_view(dy);
  set_saved(a, saved.view({a.tokens, -1}));
  if (need_hidden) set_d_hidden(a, d_hidden);
  auto ptr = [](bool need, Tensor& t) { return need ? t.data_ptr() : nullptr; };
  a.dx = ptr(need_dx, dx);
  a.dw1 = ptr(need_dw1, dw1);
  a.db1 = ptr(need_db1, db1);
  a.dw2 = ptr(need_dw2, dw2);
  a.db2 = ptr(need_db2, db2);
  a.dw_up = ptr(a.gated && need_dw_up, dw_up);
  a.db_up = ptr(a.gated && need_db_up, db_up);
  {
    py::gil_scoped_release no_gil;
    cpu::kernels().ffn_bwd(a);
  }
  return {dx, dw1, db1, dw2, db2, dw_up, db_up};
}

// ---- the FFN's two layers as separate calls (FfnLayers; ops/ffn.py's gated eager route) ------
// ffn_linear_fwd(x, w, b) -> pre = x w^T + b, (tokens, F) contiguous: GEMM1 without activation.
// ffn_linear_bwd(d_pre, x, w, need_dx, need_dw, need_db) -> {dx, dw, db} (empty if not asked).
// ffn_down_fwd(gate, up, w2, b2, o) -> y = (act(gate) [* up]) w2^T + b2, (tokens, D).
// ffn_down_bwd(dy, gate, up, w2, o, need_pre, need_dw2, need_db2) -> {d_gate, d_up, dw2, db2}.
// gate / up / d_pre: (tokens, F) contiguous; x, dy: (..., D) with any strides. No dropout.
inline cpu::FfnArgs ffn_layer_args(const Tensor& like, int64_t tokens, int64_t d_model,
                                   int64_t hidden, int32_t layers, const FfnOptions& o) {
  check_cpu(like, "ffn");
  TORCH_CHECK(o.activation >= 0 && o.activation <= 3, "fastformer._C ffn: activation code must be 0..3");
  TORCH_CHECK(o.dropout_p == 0.0, "fastformer._C ffn layers: no dropout");
  cpu::FfnArgs a;
  a.dtype = to_dtype(like);
  a.activation = static_cast<int32_t>(o.activation);
  a.layers = layers;
  a.tokens = tokens;
  a.d_model = d_model;
  a.hidden = hidden;
  return a;
}

inline void check_hidden_rows(const Tensor& t, const cpu::FfnArgs& a, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == a.tokens && t.size(1) == a.hidden && t.is_contiguous()
              && t.scalar_type() == to_scalar_type(a.dtype),
              "fastformer._C ffn layers: ", name, " must be (tokens, F) contiguous in the dtype");
}

inline void run_ffn(cpu::FfnArgs& a, bool backward) {
  if (a.tokens == 0) return;
  py::gil_scoped_release no_gil;
  if (backward) cpu::kernels().ffn_bwd(a);
  else cpu::kernels().ffn_fwd(a);
}

inline Tensor ffn_linear_fwd(const Tensor& x, const Tensor& w, const optional<Tensor>& b) {
  const int64_t D = x.size(-1), tokens = D == 0 ? 0 : x.numel() / D;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == D, "fastformer._C.ffn_linear_fwd: w must be (F, D)");
  cpu::FfnArgs a = ffn_layer_args(x, tokens, D, w.size(0), cpu::kFfnFirst, FfnOptions{});
  a.x = matrix_view(x);
  a.w1 = matrix_view(w);
  a.b1 = ptr_or_null(b);
  Tensor pre = at::empty({tokens, a.hidden}, x.options());
  a.hidden_buf = pre.data_ptr();
  a.store_preactivation = true;
  run_ffn(a, false);
  return pre;
}

inline std::vector<Tensor> ffn_linear_bwd(const Tensor& d_pre, const Tensor& x, const Tensor& w,
                                          bool need_dx, bool need_dw, bool need_db) {
  const int64_t D = x.size(-1), tokens = D == 0 ? 0 : x.numel() / D;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == D, "fastformer._C.ffn_linear_bwd: w must be (F, D)");
  cpu::FfnArgs a = ffn_layer_args(x, tokens, D, w.size(0), cpu::kFfnFirst, FfnOptions{});
  check_hidden_rows(d_pre, a, "d_pre");
  a.x = matrix_view(x);
  a.w1 = matrix_view(w);
  a.d_hidden = d_pre.data_ptr();
  const auto opts = x.options();
  Tensor dx = need_dx ? empty_rows(x.sizes(), x) : at::empty({0}, opts);
  Tensor dw = need_dw ? at::empty({a.hidden, D}, opts) : at::empty({0}, opts);
  Tensor db = need_db ? at::empty({a.hidden}, opts) : at::empty({0}, opts);
  a.dx = need_dx ? dx.data_ptr() : nullptr;
  a.dw1 = need_dw ? dw.data_ptr() : nullptr;
  a.db1 = need_db ? db.data_ptr() : nullptr;
  run_ffn(a, true);
  return {dx, dw, db};
}

inline cpu::FfnArgs ffn_down_args(const Tensor& gate, const optional<Tensor>& up, const Tensor& w2,
                                  const FfnOptions& o) {
  TORCH_CHECK(w2.dim() == 2 && gate.dim() == 2 && w2.size(1) == gate.size(1),
              "fastformer._C ffn_down: w2 must be (D, F) for gate (tokens, F)");
  cpu::FfnArgs a = ffn_layer_args(gate, gate.size(0), w2.size(0), w2.size(1), cpu::kFfnSecond, o);
  a.gated = present(up) != nullptr;
  check_hidden_rows(gate, a, "gate");
  if (a.gated) check_hidden_rows(*up, a, "up");
  a.w2 = matrix_view(w2);
  a.saved = gate.data_ptr();
  a.saved_up = a.gated ? up->data_ptr() : nullptr;
  a.saved_ld = a.hidden;
  return a;
}

inline Tensor ffn_down_fwd(const Tensor& gate, const optional<Tensor>& up, const Tensor& w2,
                           const optional<Tensor>& b2, const FfnOptions& o) {
  cpu::FfnArgs a = ffn_down_args(gate, up, w2, o);
  a.b2 = ptr_or_null(b2);
  a.store_preactivation = true;
  Tensor y = at::empty({a.tokens, a.d_model}, gate.options());
  a.y = y.data_ptr();
  run_ffn(a, false);
  return y;
}

inline std::vector<Tensor> ffn_down_bwd(const Tensor& dy, const Tensor& gate,
                                        const optional<Tensor>& up, const Tensor& w2,
                                        const FfnOptions& o, bool need_pre, bool need_dw2,
                                        bool need_db2) {
  cpu::FfnArgs a = ffn_down_args(gate, up, w2, o);
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == a.tokens && dy.size(1) == a.d_model,
              "fastformer._C.ffn_down_bwd: dy must be (tokens, D)");
  a.dy = matrix_view(dy);
  const auto opts = gate.options();
  auto maybe = [&](bool need, at::IntArrayRef shape) {
    return need ? at::empty(shape, opts) : at::empty({0}, opts);
  };
  Tensor d_gate = maybe(need_pre, {a.tokens, a.hidden});
  Tensor d_up = maybe(need_pre && a.gated, {a.tokens, a.hidden});
  Tensor dw2 = maybe(need_dw2, {a.d_model, a.hidden}), db2 = maybe(need_db2, {a.d_model});
  a.d_hidden = need_pre ? d_gate.data_ptr() : nullptr;
  a.d_up = need_pre && a.gated ? d_up.data_ptr() : nullptr;
  a.d_ld = a.hidden;
  a.dw2 = need_dw2 ? dw2.data_ptr() : nullptr;
  a.db2 = need_db2 ? db2.data_ptr() : nullptr;
  run_ffn(a, true);
  return {d_gate, d_up, dw2, db2};
}

// ---- the FFN's activation / gate, one elementwise pass (the cpu.onednn route) ---------------
// ffn_act_fwd(gate, up, activation, over_gate, dropout_p, rng_state) -> h = act(gate) [* up]
//   [* dropout's keep / (1 - p)] (over_gate: written over gate, which the caller must own: each
//   element of gate is read before h's is written)
// ffn_act_bwd(dh, gate, up, activation, need_h, dropout_p, rng_state) -> {d_gate, d_up (gated),
//   h (need_h; written over dh, which the caller must own)}
// gate / up / dh: (rows, F) with contiguous rows (gate and up may be the halves of one buffer).
inline void check_act_operand(const Tensor& t, const Tensor& like, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() &&
                  (t.stride(1) == 1 || t.size(1) <= 1) && t.device() == like.device(),
              "fastformer._C.ffn_act: ", what, " must be a (rows, F) matrix with contiguous rows "
              "in the pre-activation's shape, dtype and device");
}

inline cpu::FfnActArgs ffn_act_args(const Tensor& gate, const optional<Tensor>& up,
                                    int64_t activation, double dropout_p, const optional<Tensor>& rng_state) {
  check_cpu(gate, "ffn_act");
  check_act_operand(gate, gate, "gate");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "fastformer._C.ffn_act: dropout_p must be in [0, 1), got ",
              dropout_p);
  cpu::FfnActArgs a;
  a.dropout_p = dropout_p;
  std::tie(a.seed, a.offset) = seed_offset(rng_state);
  a.dtype = to_dtype(gate);
  a.activation = static_cast<int32_t>(activation);
  a.rows = gate.size(0);
  a.cols = gate.size(1);
  a.gate = gate.data_ptr();
  a.ld_gate = gate.stride(0);
  if (const Tensor* u = present(up)) {
    check_act_operand(*u, gate, "up");
    a.up = u->data_ptr();
    a.ld_up = u->stride(0);
  }
  return a;
}

inline void run_ffn_act(const cpu::FfnActArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  KernelGilRelease no_gil;
  cpu::kernels().ffn_act(a);
}

inline Tensor ffn_act_fwd(const Tensor& gate, const optional<Tensor>& up, int64_t activation,
                          bool over_gate, double dropout_p, const optional<Tensor>& rng_state) {
  cpu::FfnActArgs a = ffn_act_args(gate, up, activation, dropout_p, rng_state);
  Tensor h = over_gate ? gate : at::empty(gate.sizes(), gate.options());
  a.h = h.data_ptr();
  a.ld_h = h.stride(0);
  run_ffn_act(a);
  return h;
}

inline std::vector<Tensor> ffn_act_bwd(const Tensor& dh, const Tensor& gate,
                                       const optional<Tensor>& up, int64_t activation,
                                       bool need_h, double dropout_p, const optional<Tensor>& rng_state) {
  cpu::FfnActArgs a = ffn_act_args(gate, up, activation, dropout_p, rng_state);
  check_act_operand(dh, gate, "dh");
  a.dh = dh.data_ptr();
  a.ld_dh = dh.stride(0);
  Tensor d_gate = at::empty(gate.sizes(), gate.options()), d_up, h;
  a.d_gate = d_gate.data_ptr();
  a.ld_d_gate = d_gate.stride(0);
  if (a.up) {
    d_up = at::empty(gate.sizes(), gate.options());
    a.d_up = d_up.data_ptr();
    a.ld_d_up = d_up.stride(0);
  }
  if (need_h) {  // over dh: each element of dh is read before h's is written
    h = dh;
    a.h = h.data_ptr();
    a.ld_h = h.stride(0);
  }
  run_ffn_act(a);
  return {d_gate, d_up, h};
}

// dropout(x, p, rng_state) -> x * keep / (1 - p), keep of element e of the (rows, cols) matrix x
// (contiguous rows) as the FFN's mask: Philox(seed, offset + e) >= threshold. Its backward is
// the same call on the gradient.
inline Tensor dropout(const Tensor& x, double p, const Tensor& rng_state) {
  TORCH_CHECK(p > 0.0 && p < 1.0, "fastformer._C.dropout: p must be in (0, 1), got ", p);
  cpu::FfnActArgs a = ffn_act_args(x, std::nullopt, 0, p, rng_state);
  a.identity = true;  // with activation 0 (any code: not applied)
  Tensor y = at::empty(x.sizes(), x.options());
  a.h = y.data_ptr();
  a.ld_h = y.stride(0);
  run_ffn_act(a);
  return y;
}

// ---- few-row linear (decoding) ------------------------------------------------------------------
// linear_rows(x (rows <= 8, in), weight (out, in), bias) -> x W^T + b in x's dtype. x is
// converted to f32 (a few rows), the weight and bias are read in place.
inline Tensor linear_rows(const Tensor& x, const Tensor& weight, const optional<Tensor>& bias) {
  check_cpu(weight, "linear_rows");
  const auto wt = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (weight.stride(1) == 1 || weight.size(1) <= 1) &&
                  (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf),
              "fastformer._C.linear_rows: weight must be an f32/bf16/f16 (out, in) matrix with "
              "contiguous rows");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8 && x.size(1) == weight.size(1) &&
                  x.scalar_type() == wt,
              "fastformer._C.linear_rows: x must be (1..8, in) in the weight's dtype");
  const Tensor xf = x.to(at::kFloat).contiguous();
  const Tensor* b = present(bias);
  TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == weight.size(0) && b->scalar_type() == wt &&
                     b->is_contiguous()),
              "fastformer._C.linear_rows: bias must be a contiguous (out,) vector in the weight's "
              "dtype");
  Tensor y = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
  cpu::LinearRowsArgs a;
  a.dtype = to_dtype(weight);
  a.rows = x.size(0);
  a.in_features = weight.size(1);
  a.out_features = weight.size(0);
  a.weight = weight.data_ptr();
  a.ld_weight = weight.stride(0);
  a.x = xf.data_ptr<float>();
  a.bias = b ? b->data_ptr() : nullptr;
  a.y = y.data_ptr<float>();
  if (a.out_features > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().linear_rows(a);
  }
  return wt == at::kFloat ? y : y.to(wt);
}

// ---- weight gradient (AMX) -------------------------------------------------------------------
// weight_grad(p (k, m), q (k, n), transpose_c, out_dtype) -> C = P^T Q as (m, n), or C^T as (n, m)
// when transpose_c, in out_dtype (bf16 or f32): csrc/cpu/weight_grad.cpp. bf16 on AMX only: the
// caller asks use_amx_bf16() first.
inline Tensor weight_grad(const Tensor& p, const Tensor& q, bool transpose_c, at::ScalarType out_dtype) {
  check_cpu(p, "weight_grad");
  check_cpu(q, "weight_grad");
  const auto rows_ok = [](const Tensor& t) {
    return t.dim() == 2 && t.scalar_type() == at::kBFloat16 && (t.stride(1) == 1 || t.size(1) <= 1);
  };
  TORCH_CHECK(rows_ok(p) && rows_ok(q) && p.size(0) == q.size(0),
              "fastformer._C.weight_grad: p (k, m) and q (k, n) must be bf16 matrices with the same "
              "rows and contiguous rows, got ", p.sizes(), " ", p.scalar_type(), " and ", q.sizes(),
              " ", q.scalar_type());
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "fastformer._C.weight_grad: out_dtype must be bfloat16 or float32, got ", out_dtype);
  const int64_t k = p.size(0), m = p.size(1), n = q.size(1);
  Tensor c = transpose_c ? at::empty({n, m}, p.options().dtype(out_dtype))
                         : at::empty({m, n}, p.options().dtype(out_dtype));
  if (m == 0 || n == 0) return c;
  if (k == 0) return c.zero_();
  const cpu::WeightGradLayout layout(k, n);
  Tensor workspace = at::empty({layout.bytes}, p.options().dtype(at::kByte));
  cpu::WeightGradArgs a;
  a.k = k;
  a.m = m;
  a.n = n;
  a.p = p.data_ptr();
  a.ld_p = p.stride(0);
  a.q = q.data_ptr();
  a.ld_q = q.stride(0);
  a.out_dtype = out_dtype == at::kFloat ? DType::f32 : DType::bf16;
  a.c = c.data_ptr();
  a.ld_c = c.stride(0);
  a.transpose_c = transpose_c;
  a.workspace = workspace.data_ptr();
  {
    KernelGilRelease no_gil;
    cpu::kernels().weight_grad(a);
  }
  return c;
}

// ---- linear cross-entropy -------------------------------------------------------------------
// The row pass over one chunk of logits (the chunk loop and its GEMMs run in
// fastformer/reference/linear_cross_entropy.py): loss and lse per row (compute_loss), and / or
// the logits overwritten by their gradient times grad_scale (and row_scale) (write_grad), whose
// column sums are added to dbias (f64) when given.
inline void lce_rows(const Tensor& logits, const Tensor& target, const Tensor& loss,
                     const Tensor& lse, const optional<Tensor>& row_scale,
                     const optional<Tensor>& dbias, const LinearCrossEntropyOptions& o,
                     double grad_scale, bool compute_loss, bool write_grad) {
  check_cpu(logits, "lce_rows");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "fastformer._C.lce_rows: logits must be a contiguous (rows, vocab) matrix");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::ScalarType acc = stats_dtype(logits);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == rows,
              "fastformer._C.lce_rows: target must be a contiguous int64 vector of the rows");
  for (const Tensor* t : {&loss, &lse})
    TORCH_CHECK(t->scalar_type() == acc && t->is_contiguous() && t->numel() == rows,
                "fastformer._C.lce_rows: loss and lse must be contiguous (rows,) in the "
                "accumulation dtype");
  const Tensor* rs = present(row_scale);
  TORCH_CHECK(!rs || (rs->scalar_type() == acc && rs->is_contiguous() && rs->numel() == rows),
              "fastformer._C.lce_rows: row_scale must be contiguous (rows,) in the accumulation "
              "dtype");
  const Tensor* db = present(dbias);
  TORCH_CHECK(!db || (db->scalar_type() == at::kDouble && db->is_contiguous() &&
                      db->numel() == vocab),
              "fastformer._C.lce_rows: dbias must be a contiguous float64 (vocab,) vector");
  cpu::LceRowsArgs a;
  a.dtype = to_dtype(logits);
  a.rows = rows;
  a.vocab = vocab;
  a.logits = logits.data_ptr();
  a.target = target.data_ptr<int64_t>();
  a.ignore_index = o.ignore_index;
  a.label_smoothing = o.label_smoothing;
  a.softcap = o.softcap;
  a.compute_loss = compute_loss;
  a.loss = loss.data_ptr();
  a.lse = lse.data_ptr();
  a.write_grad = write_grad;
  a.grad_scale = grad_scale;
  a.row_scale = rs ? rs->data_ptr() : nullptr;
  a.dbias = db ? db->data_ptr() : nullptr;
  if (rows > 0 && vocab > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().lce_rows(a);
  }
}

// hi + lo += p in place (compensated accumulation in a pair of buffers of p's dtype); lo is
// not read when read_lo is false (taken as 0) and not written when write_lo is false, and may
// then be None.
inline void lce_pair_add(const Tensor& hi, const optional<Tensor>& lo, const Tensor& p, bool read_lo,
                         bool write_lo) {
  check_cpu(hi, "lce_pair_add");
  const bool uses_lo = read_lo || write_lo;
  TORCH_CHECK(!uses_lo || present(lo), "fastformer._C.lce_pair_add: lo is read or written, but None");
  for (const Tensor* t : {&hi, uses_lo ? &*lo : &hi, &p})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == p.scalar_type() &&
                    t->numel() == p.numel(),
                "fastformer._C.lce_pair_add: hi, lo and p must be contiguous, of one dtype and size");
  cpu::PairAddArgs a;
  a.dtype = to_dtype(p);
  a.n = p.numel();
  a.hi = hi.data_ptr();
  a.lo = uses_lo ? lo->data_ptr() : nullptr;
  a.p = p.data_ptr();
  a.read_lo = read_lo;
  a.write_lo = write_lo;
  if (a.n > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().lce_pair_add(a);
  }
}

}  // namespace cpu_bindings
}  // namespace fastformer
