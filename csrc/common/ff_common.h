// Shared definitions for math written once and compiled by both the host compiler (CPU kernels,
// where it is unit-tested) and nvcc (CUDA kernels). Headers in csrc/common include no torch
// headers and no host-only library, so a .cu file can include them freely.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FF_HOST_DEVICE __host__ __device__ __forceinline__
#define FF_DEVICE_COMPILE 1
#else
#define FF_HOST_DEVICE inline
#endif

#include <stdint.h>

namespace fastformer {

// Element types a kernel can be asked to read or write. The numbering is part of the ABI
// between fastformer/_C bindings and the kernels; keep it stable.
enum class DType : int32_t { f32 = 0, f16 = 1, bf16 = 2, f64 = 3 };

inline int64_t dtype_size(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : 2; }

}  // namespace fastformer
