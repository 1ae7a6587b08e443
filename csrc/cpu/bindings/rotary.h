// CPU bindings: the rotary position embedding.
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

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

}  // namespace cpu_bindings
}  // namespace fastformer
