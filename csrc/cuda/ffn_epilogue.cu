// FFN epilogues, CUDA: fused elementwise kernels on the output of the FFN's first GEMM (the GEMMs
// themselves are cuBLAS calls made by torch). fp32/fp16/bf16 data, fp32 math; the per-element
// formulas are common/activations.h's, shared with the CPU kernels.
//   bias_act fwd:   y = act(x + b)
//   bias_act bwd:   dx = dy * act'(x + b)   db = sum over rows of dx   (act recomputed from x)
//   gated fwd:      h = act(gate) * up                                 (SwiGLU, GeGLU, ReGLU)
//   gated bwd:      dgate = dh * up * act'(gate)   dup = dh * act(gate)
// Memory traffic per element: fwd reads 1 (gated: 2) and writes 1; bwd reads 2 (gated: 3) and
// writes 1 (gated: 2), plus for db one fp32 partial row per row group.
//
// Layout: grid.x walks column chunks, grid.y row groups; each thread owns kVec = 16 / sizeof(T)
// consecutive columns of one chunk (a 16-byte load/store per matrix when every pointer and row
// stride allows it, else element by element) and walks the rows of its group. The bias grad is
// deterministic: each thread keeps fp32 sums of its columns over its rows, writes them to its
// row group's partial row, and a second kernel adds the partial rows in order (fp64).
// Budget: no shared memory; registers ~30-40 per thread at 256 threads.
#include <algorithm>

#include "common/activations.h"
#include "cuda/cuda_kernels.h"
#include "cuda/cuda_types.cuh"

namespace fastformer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowGroups = 65535;  // grid.y limit

template <typename T>
constexpr int kVecWidth = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk

// This thread's columns [col, col + kN) of the (rows, cols) matrices of a kernel, read as and
// written from floats. kVector: every chunk is in range and 16-byte aligned (one vector access
// per row); otherwise element by element, columns past `cols` reading as 0 and not written.
template <typename T, bool kVector>
struct Chunk {
  static constexpr int kN = kVecWidth<T>;
  int64_t col, cols;

  __device__ __forceinline__ Chunk(int64_t cols_)
      : col((static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kN), cols(cols_) {}

  __device__ __forceinline__ bool empty() const { return col >= cols; }

  __device__ __forceinline__ void load(float (&v)[kN], const void* base, int64_t row,
                                       int64_t row_stride) const {
    const T* src = static_cast<const T*>(base) + row * row_stride + col;
    if constexpr (kVector) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = to_float<T>(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = col + i < cols ? to_float<T>(src[i]) : 0.f;
    }
  }

  __device__ __forceinline__ void store(void* base, int64_t row, int64_t row_stride,
                                        const float (&v)[kN]) const {
    T* dst = static_cast<T*>(base) + row * row_stride + col;
    if constexpr (kVector) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kN; ++i) e[i] = from_float<T>(v[i]);
      *reinterpret_cast<uint4*>(dst) = raw;
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (col + i < cols) dst[i] = from_float<T>(v[i]);
    }
  }

  __device__ __forceinline__ void load_bias(float (&b)[kN], const void* bias, DType dtype) const {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      b[i] = col + i < cols ? read_param(bias, dtype, col + i, 0.f) : 0.f;
  }
};

template <typename T, Activation A, bool kVector>
__global__ void __launch_bounds__(kThreads) bias_act_fwd_kernel(const BiasActFwdParams p) {
  using C = Chunk<T, kVector>;
  const C chunk(p.cols);
  if (chunk.empty()) return;
  float b[C::kN];
  chunk.load_bias(b, p.bias, p.bias_dtype);
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float v[C::kN];
    chunk.load(v, p.x, row, p.x_row_stride);
#pragma unroll
    for (int i = 0; i < C::kN; ++i) v[i] = activation<A>(v[i] + b[i]);
    chunk.store(p.y, row, p.y_row_stride, v);
  }
}

template <typename T, Activation A, bool kVector>
__global__ void __launch_bounds__(kThreads) bias_act_bwd_kernel(const BiasActBwdParams p) {
  using C = Chunk<T, kVector>;
  const C chunk(p.cols);
  if (chunk.empty()) return;
  float b[C::kN], db[C::kN] = {};
  chunk.load_bias(b, p.bias, p.bias_dtype);
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float x[C::kN], g[C::kN];
    chunk.load(x, p.x, row, p.x_row_stride);
    chunk.load(g, p.dy, row, p.dy_row_stride);
#pragma unroll
    for (int i = 0; i < C::kN; ++i) {
      g[i] *= activation_value_grad<A>(x[i] + b[i]).grad;
      db[i] += g[i];
    }
    chunk.store(p.dx, row, p.dx_row_stride, g);
  }
  if (p.dbias_part != nullptr) {
    float* part = p.dbias_part + blockIdx.y * p.cols;
#pragma unroll
    for (int i = 0; i < C::kN; ++i)
      if (chunk.col + i < p.cols) part[chunk.col + i] = db[i];
  }
}

// out[j] = sum over row groups g (in order) of part[g * cols + j], in out_dtype.
__global__ void sum_row_groups_kernel(const float* part, int groups, int64_t cols, void* out,
                                      DType out_dtype) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  double acc = 0.0;
  for (int g = 0; g < groups; ++g) acc += part[g * cols + j];
  switch (out_dtype) {
    case DType::f16: static_cast<__half*>(out)[j] = __double2half(acc); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(out)[j] = __double2bfloat16(acc); break;
    default: static_cast<float*>(out)[j] = static_cast<float>(acc); break;
  }
}

template <typename T, Activation A, bool kVector>
__global__ void __launch_bounds__(kThreads) gated_act_fwd_kernel(const GatedActFwdParams p) {
  using C = Chunk<T, kVector>;
  const C chunk(p.cols);
  if (chunk.empty()) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float gate[C::kN], up[C::kN];
    chunk.load(gate, p.gate, row, p.gate_row_stride);
    chunk.load(up, p.up, row, p.up_row_stride);
#pragma unroll
    for (int i = 0; i < C::kN; ++i) gate[i] = activation<A>(gate[i]) * up[i];
    chunk.store(p.h, row, p.h_row_stride, gate);
  }
}

template <typename T, Activation A, bool kVector>
__global__ void __launch_bounds__(kThreads) gated_act_bwd_kernel(const GatedActBwdParams p) {
  using C = Chunk<T, kVector>;
  const C chunk(p.cols);
  if (chunk.empty()) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float dh[C::kN], gate[C::kN], up[C::kN];
    chunk.load(dh, p.dh, row, p.dh_row_stride);
    chunk.load(gate, p.gate, row, p.gate_row_stride);
    chunk.load(up, p.up, row, p.up_row_stride);
#pragma unroll
    for (int i = 0; i < C::kN; ++i) {
      const ValueGrad<float> a = activation_value_grad<A>(gate[i]);
      gate[i] = dh[i] * up[i] * a.grad;  // d gate
      up[i] = dh[i] * a.value;           // d up
    }
    chunk.store(p.dgate, row, p.dgate_row_stride, gate);
    chunk.store(p.dup, row, p.dup_row_stride, up);
  }
}

// Whether every (pointer, row stride) allows 16-byte chunks of T at every chunk start.
template <typename T>
bool vectorizable(int64_t cols, std::initializer_list<std::pair<const void*, int64_t>> matrices) {
  if (cols % kVecWidth<T> != 0) return false;
  for (const auto& [ptr, stride] : matrices)
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || stride % kVecWidth<T> != 0) return false;
  return true;
}

template <typename T>
dim3 grid_for(int64_t rows, int64_t cols, int row_groups) {
  const int64_t chunk = static_cast<int64_t>(kThreads) * kVecWidth<T>;
  return dim3(static_cast<unsigned>((cols + chunk - 1) / chunk), static_cast<unsigned>(row_groups));
}

int default_row_groups(int64_t rows) {
  return static_cast<int>(std::min<int64_t>(rows, kMaxRowGroups));
}

// f(T{}, tag, bool_constant<kVector>) for p's dtype and activation.
template <typename Params, typename F>
void dispatch(const Params& p, bool vector_ok_f32, bool vector_ok_16, F&& f) {
  dispatch_cuda_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    const bool vec = sizeof(T) == 4 ? vector_ok_f32 : vector_ok_16;
    dispatch_activation(p.act, [&](auto act_tag) {
      if (vec)
        f(type_tag, act_tag, std::true_type{});
      else
        f(type_tag, act_tag, std::false_type{});
    });
  });
}

// Launches the instantiation kernel_of(type tag, activation tag, vectorized?) returns for the
// call's dtype, activation and vectorizability (mats: the (pointer, row stride) pairs it reads
// and writes), on a grid of `groups` row groups. Written once for the four epilogues below.
template <class Params, class KernelOf>
void launch(const Params& p, std::initializer_list<std::pair<const void*, int64_t>> mats, int groups,
            cudaStream_t stream, KernelOf kernel_of) {
  dispatch(p, vectorizable<float>(p.cols, mats), vectorizable<__half>(p.cols, mats),
           [&](auto type_tag, auto act_tag, auto vec) {
             using T = decltype(type_tag);
             const auto kernel = kernel_of(type_tag, act_tag, vec);
             kernel<<<grid_for<T>(p.rows, p.cols, groups), kThreads, 0, stream>>>(p);
           });
}

// The kernel template K instantiated for launch()'s tags.
#define FF_EPILOGUE_KERNEL(K)                                                     \
  [](auto type_tag, auto act_tag, auto vec) {                                     \
    return K<decltype(type_tag), decltype(act_tag)::value, decltype(vec)::value>; \
  }

}  // namespace

int bias_act_bwd_row_groups(int64_t rows, int64_t cols, int sm_count) {
  (void)cols;  // at least 16 rows per group: the partial row costs as much as 16 rows of dx
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows / 16, 2 * sm_count)));
}

cudaError_t bias_act_fwd(const BiasActFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  launch(p, {{p.x, p.x_row_stride}, {p.y, p.y_row_stride}}, default_row_groups(p.rows), stream,
         FF_EPILOGUE_KERNEL(bias_act_fwd_kernel));
  return cudaGetLastError();
}

cudaError_t bias_act_bwd(const BiasActBwdParams& p, cudaStream_t stream) {
  if (p.cols == 0) return cudaSuccess;
  const int groups = p.dbias != nullptr ? p.row_groups : default_row_groups(p.rows);
  if (p.rows > 0) {
    launch(p, {{p.x, p.x_row_stride}, {p.dy, p.dy_row_stride}, {p.dx, p.dx_row_stride}}, groups, stream,
           FF_EPILOGUE_KERNEL(bias_act_bwd_kernel));
  } else if (p.dbias != nullptr) {
    cudaMemsetAsync(p.dbias_part, 0, sizeof(float) * p.cols * groups, stream);
  }
  if (p.dbias != nullptr) {
    sum_row_groups_kernel<<<static_cast<unsigned>((p.cols + 255) / 256), 256, 0, stream>>>(
        p.dbias_part, groups, p.cols, p.dbias, p.bias_dtype);
  }
  return cudaGetLastError();
}

cudaError_t gated_act_fwd(const GatedActFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  launch(p, {{p.gate, p.gate_row_stride}, {p.up, p.up_row_stride}, {p.h, p.h_row_stride}},
         default_row_groups(p.rows), stream, FF_EPILOGUE_KERNEL(gated_act_fwd_kernel));
  return cudaGetLastError();
}

cudaError_t gated_act_bwd(const GatedActBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  launch(p,
         {{p.dh, p.dh_row_stride}, {p.gate, p.gate_row_stride}, {p.up, p.up_row_stride},
          {p.dgate, p.dgate_row_stride}, {p.dup, p.dup_row_stride}},
         default_row_groups(p.rows), stream, FF_EPILOGUE_KERNEL(gated_act_bwd_kernel));
  return cudaGetLastError();
}

}  // namespace fastformer::cuda
