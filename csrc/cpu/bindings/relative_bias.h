// CPU bindings: DeBERTa's disentangled relative-position bias (csrc/cpu/relative_bias.cpp).
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

// The argument struct of one call; the tensors' shapes were validated in Python
// (fastformer/ops/relative_bias.py), rechecked here as the kernels' preconditions. The backward
// passes stand-ins of c2p / p2c (their shape and dtype; `read` false): their data is not read.
// The kernels read the index tables as int32 (their vector gathers take 32-bit indices): the
// copies made here (once per call, with the range check) live in `tables` for the call.
inline cpu::RelativeBiasArgs relative_bias_args(const Tensor* c2p, const Tensor* p2c, int64_t Lq,
                                                const RelativeBiasOptions& o, bool read, Tensor (&tables)[2]) {
  const Tensor* any = c2p ? c2p : p2c;
  TORCH_CHECK(any != nullptr, "fastformer._C.relative_bias: c2p or p2c is needed");
  check_cpu(*any, "relative_bias");
  const Tensor* ci = present(o.c2p_index);
  const Tensor* pi = present(o.p2c_index);
  const Tensor* vis = present(o.visible);
  cpu::RelativeBiasArgs a;
  a.dtype = to_dtype(*any);
  a.B = any->size(0); a.H = any->size(1); a.W = any->size(3); a.Lq = Lq;
  TORCH_CHECK(a.W < (int64_t{1} << 24), "fastformer._C.relative_bias: W (c2p / p2c's last dim) must be "
              "below 2^24 (the kernels' 32-bit gather offsets), got ", a.W);
  a.Lk = ci ? ci->size(1) : pi->size(1);
  for (const Tensor* t : {c2p, p2c}) {
    TORCH_CHECK(!t || (t->dim() == 4 && (!read || t->is_contiguous()) && t->scalar_type() == any->scalar_type() &&
                       t->size(0) == a.B && t->size(1) == a.H && t->size(3) == a.W),
                "fastformer._C.relative_bias: c2p / p2c must be contiguous (B, H, L, W) of one dtype");
  }
  TORCH_CHECK(!c2p || (ci && c2p->size(2) == Lq), "fastformer._C.relative_bias: c2p needs c2p_index");
  TORCH_CHECK(!p2c || (pi && p2c->size(2) == a.Lk), "fastformer._C.relative_bias: p2c needs p2c_index");
  for (const Tensor* t : {ci, pi}) {
    TORCH_CHECK(!t || (t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 2 &&
                       t->size(0) == Lq && t->size(1) == a.Lk),
                "fastformer._C.relative_bias: index tables must be contiguous int64 (Lq, Lk)");
  }
  TORCH_CHECK(!vis || (vis->scalar_type() == at::kBool && vis->is_contiguous() && vis->dim() == 3 &&
                       (vis->size(0) == 1 || vis->size(0) == a.B) && vis->size(1) == Lq &&
                       vis->size(2) == a.Lk),
              "fastformer._C.relative_bias: visible must be a contiguous bool (1 or B, Lq, Lk)");
  // The int32 copies, range-checked in the same pass: the kernels index with the tables, and a
  // value out of [0, W) would read or write past a row.
  const Tensor* used[2] = {c2p ? ci : nullptr, p2c ? pi : nullptr};
  for (int k = 0; k < 2; ++k) {
    if (!used[k]) continue;
    const int64_t* v = used[k]->data_ptr<int64_t>();
    tables[k] = at::empty(used[k]->sizes(), used[k]->options().dtype(at::kInt));
    int32_t* narrow = tables[k].data_ptr<int32_t>();
    bool in_range = true;
    for (int64_t e = 0; e < used[k]->numel(); ++e) {
      in_range &= v[e] >= 0 && v[e] < a.W;
      narrow[e] = static_cast<int32_t>(v[e]);
    }
    TORCH_CHECK(in_range, "fastformer._C.relative_bias: index tables must hold values in [0, W = ", a.W, ")");
  }
  a.Bv = vis ? vis->size(0) : 1;
  a.c2p = c2p && read ? c2p->data_ptr() : nullptr;
  a.p2c = p2c && read ? p2c->data_ptr() : nullptr;
  a.c2p_index = c2p ? tables[0].data_ptr<int32_t>() : nullptr;
  a.p2c_index = p2c ? tables[1].data_ptr<int32_t>() : nullptr;
  a.visible = vis ? vis->data_ptr<bool>() : nullptr;
  return a;
}

inline Tensor relative_bias_fwd(const optional<Tensor>& c2p, const optional<Tensor>& p2c,
                                const RelativeBiasOptions& o) {
  const Tensor* ci = present(o.c2p_index);
  const Tensor* pi = present(o.p2c_index);
  const int64_t Lq = ci ? ci->size(0) : (pi ? pi->size(0) : 0);
  Tensor tables[2];
  cpu::RelativeBiasArgs a = relative_bias_args(present(c2p), present(p2c), Lq, o, true, tables);
  const Tensor& like = present(c2p) ? *c2p : *p2c;
  Tensor out = at::empty({a.B, a.H, a.Lq, a.Lk}, like.options().memory_format(at::MemoryFormat::Contiguous));
  a.out = out.data_ptr();
  if (out.numel() > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().relative_bias_fwd(a);
  }
  return out;
}

// dout (B, H, Lq, Lk) contiguous; c2p / p2c: stand-ins of the forward's inputs (their shapes and
// dtype), or None where that gradient is not wanted.
inline std::tuple<optional<Tensor>, optional<Tensor>> relative_bias_bwd(
    const Tensor& dout, const optional<Tensor>& c2p, const optional<Tensor>& p2c,
    const RelativeBiasOptions& o) {
  TORCH_CHECK(dout.dim() == 4 && dout.is_contiguous(),
              "fastformer._C.relative_bias_bwd: dout must be contiguous (B, H, Lq, Lk)");
  optional<Tensor> dc2p, dp2c;
  if (!present(c2p) && !present(p2c)) return {dc2p, dp2c};
  Tensor tables[2];
  cpu::RelativeBiasArgs a = relative_bias_args(present(c2p), present(p2c), dout.size(2), o, false, tables);
  TORCH_CHECK(dout.scalar_type() == to_scalar_type(a.dtype) && dout.size(0) == a.B &&
                  dout.size(1) == a.H && dout.size(3) == a.Lk,
              "fastformer._C.relative_bias_bwd: dout must be the forward output's shape and dtype");
  a.dout = dout.data_ptr();
  if (present(c2p)) {
    dc2p = at::empty_like(*c2p, at::MemoryFormat::Contiguous);
    a.dc2p = dc2p->data_ptr();
  }
  if (present(p2c)) {
    dp2c = at::empty_like(*p2c, at::MemoryFormat::Contiguous);
    a.dp2c = dp2c->data_ptr();
  }
  if (dout.numel() > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().relative_bias_bwd(a);
  } else {
    if (dc2p) dc2p->zero_();
    if (dp2c) dp2c->zero_();
  }
  return {dc2p, dp2c};
}

}  // namespace cpu_bindings
}  // namespace fastformer
