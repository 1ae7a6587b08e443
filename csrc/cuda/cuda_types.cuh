// Element-type helpers for the CUDA kernels: read any supported type as float, write float back
// with round-to-nearest-even. No torch headers: .cu files stay fast to compile.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/ff_common.h"

namespace fastformer::cuda {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Round v to T's precision and back (what an eager op producing a T tensor does).
template <typename T> __device__ __forceinline__ float round_to(float v) {
  return to_float<T>(from_float<T>(v));
}

// Call f(T{}) with T the CUDA element type named by `dtype` (f32, f16, bf16).
template <typename F>
inline void dispatch_cuda_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f16: f(__half{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    default: f(float{}); break;
  }
}

__device__ __forceinline__ float read_param(const void* p, DType dtype, int64_t i, float fill) {
  if (p == nullptr) return fill;
  switch (dtype) {
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

}  // namespace fastformer::cuda
