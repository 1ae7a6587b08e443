// Fused residual-add + LayerNorm / RMSNorm, CUDA, forward and backward (fp32/fp16/bf16).
//
// Forward: one block of kThreads per row (grid-stride over rows). Pass 1: each thread walks the
// columns j = tid, tid + kThreads, ... computing z = x + residual (rounded to T, as eager's add)
// and a Welford state; residual_out is written here. The states are merged with the shared
// Chan formula (common/welford.h), first across the warp with shuffles, then across warps in
// shared memory. Pass 2 re-reads x and residual (L1/L2 hits: the row was just read) and writes y.
// DRAM traffic per element: read x, residual; write y (+ residual_out).
//
// Backward: a fixed grid (about two blocks per SM), each block walking rows blockIdx.x,
// blockIdx.x + gridDim.x, ...: pass 1 reduces sum(g * x_hat) and sum(g) over the row, pass 2
// writes dz = (g - x_hat*c_xhat - c_g) * rstd (+ d residual_out) and adds dy*x_hat, dy into the
// block's fp32 partial row (thread t always owns the same columns: no atomics). A second kernel
// sums the partial rows in block order, so dweight/dbias are deterministic.
//
// Budget: no shared memory beyond 32 Welford states (384 B); registers ~40/thread at 256 threads.
#include <algorithm>

#include "common/norm_math.h"
#include "common/welford.h"
#include "cuda/cuda_kernels.h"
#include "cuda/cuda_types.cuh"

namespace fastformer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ WelfordState<float> block_welford(WelfordState<float> s) {
  __shared__ WelfordState<float> warp_states[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    WelfordState<float> other{__shfl_xor_sync(kFullMask, s.count, offset),
                              __shfl_xor_sync(kFullMask, s.mean, offset),
                              __shfl_xor_sync(kFullMask, s.m2, offset)};
    s = welford_merge(s, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / 32 ? warp_states[lane] : WelfordState<float>{0.f, 0.f, 0.f};
    for (int offset = 16; offset > 0; offset >>= 1) {
      WelfordState<float> other{__shfl_xor_sync(kFullMask, s.count, offset),
                                __shfl_xor_sync(kFullMask, s.mean, offset),
                                __shfl_xor_sync(kFullMask, s.m2, offset)};
      s = welford_merge(s, other);
    }
    if (lane == 0) warp_states[0] = s;
  }
  __syncthreads();
  s = warp_states[0];
  __syncthreads();  // warp_states is reused by the next row
  return s;
}

// Sum of two floats over the block (every thread gets the totals).
__device__ __forceinline__ float2 block_sum2(float2 v) {
  __shared__ float2 warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    v.x += __shfl_xor_sync(kFullMask, v.x, offset);
    v.y += __shfl_xor_sync(kFullMask, v.y, offset);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : make_float2(0.f, 0.f);
    for (int offset = 16; offset > 0; offset >>= 1) {
      v.x += __shfl_xor_sync(kFullMask, v.x, offset);
      v.y += __shfl_xor_sync(kFullMask, v.y, offset);
    }
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  v = warp_sums[0];
  __syncthreads();
  return v;
}

template <typename T>
__device__ __forceinline__ float load_z(const T* a, const T* b, int64_t j) {
  float z = to_float<T>(a[j]);
  return b ? round_to<T>(z + to_float<T>(b[j])) : z;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) add_norm_fwd_kernel(const NormFwdParams p) {
  const int64_t H = p.hidden;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    const T* r = p.residual ? static_cast<const T*>(p.residual) + row * p.residual_row_stride : nullptr;
    T* res_out = p.residual_out ? static_cast<T*>(p.residual_out) + row * H : nullptr;

    WelfordState<float> st{0.f, 0.f, 0.f};
    float sum_sq = 0.f;
    for (int64_t j = threadIdx.x; j < H; j += kThreads) {
      const float z = load_z<T>(x, r, j);
      if (res_out) res_out[j] = from_float<T>(z);
      if (p.rms) {
        sum_sq += z * z;
      } else {
        st.count += 1.f;
        welford_push(st.mean, st.m2, z, 1.f / st.count);
      }
    }
    float mean = 0.f, rstd;
    if (p.rms) {
      rstd = rsqrtf(block_sum2(make_float2(sum_sq, 0.f)).x / H + p.eps);
    } else {
      st = block_welford(st);
      mean = st.mean;
      rstd = rsqrtf(st.m2 / H + p.eps);
    }
    if (threadIdx.x == 0) {
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    T* y = static_cast<T*>(p.y) + row * H;
    for (int64_t j = threadIdx.x; j < H; j += kThreads) {
      const float x_hat = norm_x_hat(load_z<T>(x, r, j), mean, rstd);
      const float w = read_param(p.weight, p.param_dtype, j, 1.f);
      const float b = read_param(p.bias, p.param_dtype, j, 0.f);
      y[j] = from_float<T>(norm_affine(x_hat, w, b));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) add_norm_bwd_kernel(const NormBwdParams p) {
  const int64_t H = p.hidden;
  float* dw_acc = p.dw_part ? p.dw_part + blockIdx.x * H : nullptr;
  float* db_acc = p.db_part ? p.db_part + blockIdx.x * H : nullptr;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* za = static_cast<const T*>(p.z_a) + row * p.z_a_row_stride;
    const T* zb = p.z_b ? static_cast<const T*>(p.z_b) + row * p.z_b_row_stride : nullptr;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_row_stride;
    const float mean = p.mean ? p.mean[row] : 0.f;
    const float rstd = p.rstd[row];

    float2 sums = make_float2(0.f, 0.f);  // (sum g*x_hat, sum g)
    for (int64_t j = threadIdx.x; j < H; j += kThreads) {
      const float x_hat = norm_x_hat(load_z<T>(za, zb, j), mean, rstd);
      const float g = to_float<T>(dy[j]) * read_param(p.weight, p.param_dtype, j, 1.f);
      sums.x += g * x_hat;
      sums.y += g;
    }
    sums = block_sum2(sums);
    const float c_xhat = sums.x / H;
    const float c_g = p.rms ? 0.f : sums.y / H;

    T* dz = static_cast<T*>(p.dz) + row * H;
    const T* dres = p.dres ? static_cast<const T*>(p.dres) + row * p.dres_row_stride : nullptr;
    for (int64_t j = threadIdx.x; j < H; j += kThreads) {
      const float x_hat = norm_x_hat(load_z<T>(za, zb, j), mean, rstd);
      const float dyj = to_float<T>(dy[j]);
      const float g = dyj * read_param(p.weight, p.param_dtype, j, 1.f);
      float d = norm_dz(g, x_hat, c_xhat, c_g, rstd);
      if (dres) d += to_float<T>(dres[j]);
      dz[j] = from_float<T>(d);
      if (dw_acc) dw_acc[j] += dyj * x_hat;
      if (db_acc) db_acc[j] += dyj;
    }
  }
}

// out[j] = sum over blocks b (in order) of part[b * H + j], written in the parameter dtype.
__global__ void sum_partials_kernel(const float* part, int num_blocks, int64_t H, void* out,
                                    DType out_dtype) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  double acc = 0.0;  // fp64: hundreds of partials summed in order
  for (int b = 0; b < num_blocks; ++b) acc += part[b * H + j];
  switch (out_dtype) {
    case DType::f16: static_cast<__half*>(out)[j] = __double2half(acc); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(out)[j] = __double2bfloat16(acc); break;
    default: static_cast<float*>(out)[j] = static_cast<float>(acc); break;
  }
}

int row_blocks(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, 1 << 16)); }

}  // namespace

int norm_bwd_blocks(int64_t rows, int sm_count) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 2 * sm_count)));
}

cudaError_t add_norm_fwd(const NormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  dispatch_cuda_dtype(p.dtype, [&](auto tag) {
    add_norm_fwd_kernel<decltype(tag)><<<row_blocks(p.rows), kThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

cudaError_t add_norm_bwd(const NormBwdParams& p, cudaStream_t stream) {
  const size_t part_bytes = sizeof(float) * p.num_blocks * p.hidden;
  if (p.dw_part) cudaMemsetAsync(p.dw_part, 0, part_bytes, stream);
  if (p.db_part) cudaMemsetAsync(p.db_part, 0, part_bytes, stream);
  if (p.rows > 0) {
    dispatch_cuda_dtype(p.dtype, [&](auto tag) {
      add_norm_bwd_kernel<decltype(tag)><<<p.num_blocks, kThreads, 0, stream>>>(p);
    });
  }
  const int reduce_blocks = static_cast<int>((p.hidden + 255) / 256);
  if (p.dweight && reduce_blocks > 0)
    sum_partials_kernel<<<reduce_blocks, 256, 0, stream>>>(p.dw_part, p.num_blocks, p.hidden,
                                                           p.dweight, p.param_dtype);
  if (p.dbias && reduce_blocks > 0)
    sum_partials_kernel<<<reduce_blocks, 256, 0, stream>>>(p.db_part, p.num_blocks, p.hidden,
                                                           p.dbias, p.param_dtype);
  return cudaGetLastError();
}

}  // namespace fastformer::cuda
