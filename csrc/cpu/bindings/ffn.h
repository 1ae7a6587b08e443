// CPU bindings: the feed-forward block (fused, its two layers as separate calls, the activation
// pass of the cpu.onednn route) and the dropout on its Philox mask.
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

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
  TORCH_CHECK(o.activation >= 0 && o.activation <= 5, "fastformer._C ffn: activation code must be 0..5");
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
// as [gate | up]) when save (a backward follows), else empty.
inline std::vector<Tensor> ffn_fwd(const Tensor& x, const Tensor& w1, const optional<Tensor>& b1,
                                   const Tensor& w2, const optional<Tensor>& b2,
                                   const optional<Tensor>& w_up, const optional<Tensor>& b_up,
                                   const FfnOptions& o, bool save) {
  cpu::FfnArgs a = ffn_args(x, w1, w2, w_up, o);
  a.b1 = ptr_or_null(b1);
  a.b2 = ptr_or_null(b2);
  a.b_up = a.gated ? ptr_or_null(b_up) : nullptr;
  Tensor y = empty_rows(x.sizes(), x);
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
// ffn_linear_fwd(x, w, b, out=None) -> pre = x w^T + b, (tokens, F) contiguous: GEMM1 without
// activation, written into out when given ((tokens, F) contiguous in x's dtype).
// ffn_linear_bwd(d_pre, x, w, need_dx, need_dw, need_db) -> {dx, dw, db} (empty if not asked).
// ffn_down_fwd(gate, up, w2, b2, o) -> y = (act(gate) [* up]) w2^T + b2, (tokens, D).
// ffn_down_bwd(dy, gate, up, w2, o, need_pre, need_dw2, need_db2) -> {d_gate, d_up, dw2, db2}.
// gate / up / d_pre: (tokens, F) contiguous; x, dy: (..., D) with any strides. No dropout.
inline cpu::FfnArgs ffn_layer_args(const Tensor& like, int64_t tokens, int64_t d_model,
                                   int64_t hidden, int32_t layers, const FfnOptions& o) {
  check_cpu(like, "ffn");
  TORCH_CHECK(o.activation >= 0 && o.activation <= 5, "fastformer._C ffn: activation code must be 0..5");
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

inline Tensor ffn_linear_fwd(const Tensor& x, const Tensor& w, const optional<Tensor>& b,
                             const optional<Tensor>& out) {
  const int64_t D = x.size(-1), tokens = D == 0 ? 0 : x.numel() / D;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == D, "fastformer._C.ffn_linear_fwd: w must be (F, D)");
  cpu::FfnArgs a = ffn_layer_args(x, tokens, D, w.size(0), cpu::kFfnFirst, FfnOptions{});
  a.x = matrix_view(x);
  a.w1 = matrix_view(w);
  a.b1 = ptr_or_null(b);
  const Tensor* given = present(out);
  Tensor pre = given ? *given : at::empty({tokens, a.hidden}, x.options());
  TORCH_CHECK(pre.dim() == 2 && pre.size(0) == tokens && pre.size(1) == a.hidden && pre.is_contiguous()
              && pre.scalar_type() == x.scalar_type() && pre.device().is_cpu(),
              "fastformer._C.ffn_linear_fwd: out must be (tokens, F) contiguous in x's dtype");
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
// ffn_act_fwd(gate, up, activation, over_gate, dropout_p, rng_state, limit, up_shift) -> h = act(gate) [* up]
//   [* dropout's keep / (1 - p)] (over_gate: written over gate, which the caller must own: each
//   element of gate is read before h's is written)
// ffn_act_bwd(dh, gate, up, activation, need_h, dropout_p, rng_state, limit, up_shift) -> {d_gate, d_up (gated),
//   h (need_h)}: dh is a temporary the caller owns; h, or else d_gate, is written over it (each
//   element of dh is read before that element of either is written)
// gate / up / dh: (rows, F) with contiguous rows (gate and up may be the halves of one buffer).
// limit > 0 (gated only): gate clamped above at limit and up to [-limit, limit] first; up_shift
// (gated only): up + up_shift (after the clamp) in place of up.
inline void check_act_operand(const Tensor& t, const Tensor& like, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() &&
                  (t.stride(1) == 1 || t.size(1) <= 1) && t.device() == like.device(),
              "fastformer._C.ffn_act: ", what, " must be a (rows, F) matrix with contiguous rows "
              "in the pre-activation's shape, dtype and device");
}

inline cpu::FfnActArgs ffn_act_args(const Tensor& gate, const optional<Tensor>& up,
                                    int64_t activation, double dropout_p, const optional<Tensor>& rng_state,
                                    double limit = 0.0, double up_shift = 0.0) {
  check_cpu(gate, "ffn_act");
  check_act_operand(gate, gate, "gate");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "fastformer._C.ffn_act: dropout_p must be in [0, 1), got ",
              dropout_p);
  cpu::FfnActArgs a;
  TORCH_CHECK(limit >= 0.0 && (limit == 0.0 || up.has_value()),
              "fastformer._C.ffn_act: limit must be >= 0 and set on gated calls only, got ", limit);
  TORCH_CHECK(up_shift == 0.0 || up.has_value(), "fastformer._C.ffn_act: up_shift is for gated calls only");
  a.dropout_p = dropout_p;
  a.limit = limit;
  a.up_shift = up_shift;
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
                          bool over_gate, double dropout_p, const optional<Tensor>& rng_state,
                          double limit, double up_shift) {
  cpu::FfnActArgs a = ffn_act_args(gate, up, activation, dropout_p, rng_state, limit, up_shift);
  Tensor h = over_gate ? gate : at::empty(gate.sizes(), gate.options());
  a.h = h.data_ptr();
  a.ld_h = h.stride(0);
  run_ffn_act(a);
  return h;
}

inline std::vector<Tensor> ffn_act_bwd(const Tensor& dh, const Tensor& gate,
                                       const optional<Tensor>& up, int64_t activation,
                                       bool need_h, double dropout_p, const optional<Tensor>& rng_state,
                                       double limit, double up_shift) {
  cpu::FfnActArgs a = ffn_act_args(gate, up, activation, dropout_p, rng_state, limit, up_shift);
  check_act_operand(dh, gate, "dh");
  a.dh = dh.data_ptr();
  a.ld_dh = dh.stride(0);
  Tensor d_gate = need_h ? at::empty(gate.sizes(), gate.options()) : dh, d_up, h;
  a.d_gate = d_gate.data_ptr();
  a.ld_d_gate = d_gate.stride(0);
  if (a.up) {
    d_up = at::empty(gate.sizes(), gate.options());
    a.d_up = d_up.data_ptr();
    a.ld_d_up = d_up.stride(0);
  }
  if (need_h) {
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

}  // namespace cpu_bindings
}  // namespace fastformer
