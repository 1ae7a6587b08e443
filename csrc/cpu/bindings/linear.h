// CPU bindings: few-row linear (decoding) and the weight gradient (AMX).
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

// linear_rows(x (rows, in), weight (out, in), bias) -> x W^T + b in x's dtype: rows <= 8 any
// weight dtype, more rows f32 (or bf16 on AMX / AVX512-BF16) only. x is converted to f32 (f32, 3
// or more rows: transposed, the rows zero-padded to a multiple of 16; bf16 on AMX / AVX512-BF16:
// kept as bf16 rows), the weight and bias are read in place. A weight whose
// columns are contiguous instead (a transposed view of an (in, out) matrix) takes the in-major
// form, 1..8 rows.
inline Tensor linear_rows(const Tensor& x, const Tensor& weight, const optional<Tensor>& bias) {
  check_cpu(weight, "linear_rows");
  const auto wt = weight.scalar_type();
  const bool in_major = weight.dim() == 2 && weight.stride(0) == 1 && weight.size(0) > 1 &&
                        weight.size(1) > 1 && weight.stride(1) >= weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && (weight.stride(1) == 1 || weight.size(1) <= 1 || in_major) &&
                  (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf),
              "fastformer._C.linear_rows: weight must be an f32/bf16/f16 (out, in) matrix with "
              "contiguous rows or contiguous columns");
  // bf16 weights on AMX tiles or, without AMX, on AVX512-BF16 dot products (in_features a
  // multiple of 32, x as bf16 rows): faster than the fp32 dot form (linear_rows.cpp)
  const bool bf16_rows = !in_major && wt == at::kBFloat16 && x.dim() == 2 && x.size(0) >= 1 &&
                         x.size(1) % 32 == 0 && cpu::bf16_gemm_mode() != cpu::Bf16Gemm::kFp32;
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == weight.size(1) &&
                  x.scalar_type() == wt && (x.size(0) <= 8 || (!in_major && (wt == at::kFloat || bf16_rows))),
              "fastformer._C.linear_rows: x must be (rows, in) in the weight's dtype, 1..8 rows "
              "unless the weight is f32 with contiguous rows (or bf16 on AMX or AVX512-BF16 with "
              "in a multiple of 32)");
  const bool transposed = !in_major && x.size(0) > 2 && wt == at::kFloat;  // measured: linear_rows.cpp
  Tensor xf;
  if (bf16_rows) {
    xf = x.contiguous();
  } else if (transposed) {
    const int64_t ld = (x.size(0) + 15) / 16 * 16;
    xf = at::zeros({x.size(1), ld}, x.options());
    xf.narrow(1, 0, x.size(0)).copy_(x.t());
  } else {
    xf = x.to(at::kFloat).contiguous();
  }
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
  a.ld_weight = in_major ? weight.stride(1) : weight.stride(0);
  a.weight_in_major = in_major;
  if (bf16_rows) {
    a.x_bf16 = xf.data_ptr();
  } else if (transposed) {
    a.x_t = xf.data_ptr<float>();
    a.ld_x_t = xf.size(1);
  } else {
    a.x = xf.data_ptr<float>();
  }
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

}  // namespace cpu_bindings
}  // namespace fastformer
