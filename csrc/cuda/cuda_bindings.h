// Torch-side glue for the CUDA launchers, included by csrc/bindings.cpp only when built with
// CUDA (FASTFORMER_WITH_CUDA). Allocates outputs, reads strides, passes the current stream.
// The Python layer guarantees the preconditions checked here (uniform row strides, dtypes).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "cuda/cuda_kernels.h"

namespace fastformer::cuda {

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
                                            const c10::optional<at::Tensor>& bias, double eps,
                                            bool rms, bool return_residual) {
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
  p.eps = static_cast<float>(eps);
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

}  // namespace fastformer::cuda
