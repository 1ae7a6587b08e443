// CPU bindings: add + LayerNorm / RMSNorm, forward, backward and the C++ autograd node of the eager route.
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

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

}  // namespace cpu_bindings
}  // namespace fastformer
