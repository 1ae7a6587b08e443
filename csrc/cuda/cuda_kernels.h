// Host-side declarations of the CUDA launchers. Plain pointers, sizes and strides: this header
// includes no torch header, so it is shared by the .cu files (nvcc) and the bindings (g++).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

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

}  // namespace fastformer::cuda
