// Shared tensor glue of the CPU bindings (one op family per file beside this one, all included
// by csrc/cpu/cpu_bindings.h, which csrc/bindings.cpp includes): dtype codes, the row layouts of
// strided tensors, output allocation and the GIL release around a kernel call. The kernels run
// through the table selected for the running CPU (kernels(), bindings.cpp). CPU tensors only:
// the Python selection (fastformer/backends.py) decides the backend.
//
// User-facing validation (ValueError/TypeError naming the argument) happens in Python
// (fastformer/_checks.py); the TORCH_CHECKs here guard the kernels' own preconditions, which the
// Python layer guarantees, so a failure here is a fastformer bug, not a user error.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <optional>

#include "cpu/cpu_kernels.h"
#include "options.h"

namespace fastformer {
namespace cpu {
const KernelTable& kernels();  // the table of the selected capability level (bindings.cpp)
}  // namespace cpu

namespace cpu_bindings {

namespace py = pybind11;
using at::Tensor;
using std::optional;

inline DType to_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "fastformer._C: unsupported dtype ", t.scalar_type());
  }
}

inline at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::f32: return at::kFloat;
    case DType::f64: return at::kDouble;
    case DType::bf16: return at::kBFloat16;
    case DType::f16: return at::kHalf;
  }
  return at::kFloat;
}

inline void check_cpu(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fastformer._C.", what, ": expected CPU tensors (the cuda_* "
              "functions take CUDA tensors)");
}

// Rows of a tensor viewed as (rows, last_dim): coalesce leading dims where possible. Any
// strides (row_layout() below requires a contiguous last dim).
inline cpu::RowLayout leading_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "fastformer._C: expected at least one dimension");
  cpu::RowLayout layout;
  int64_t sizes[64], strides[64];
  int n = 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 1) continue;  // size-1 dims never move the pointer
    if (n > 0 && strides[n - 1] == t.stride(d) * t.size(d)) {
      sizes[n - 1] *= t.size(d);
      strides[n - 1] = t.stride(d);
    } else {
      sizes[n] = t.size(d);
      strides[n] = t.stride(d);
      ++n;
    }
  }
  if (n == 0) {
    layout.ndim = 1;
    layout.sizes[0] = 1;
    layout.strides[0] = 0;
    return layout;
  }
  TORCH_CHECK(n <= cpu::kMaxDims, "fastformer._C: too many non-mergeable leading dims");
  layout.ndim = n;
  for (int i = 0; i < n; ++i) {
    layout.sizes[i] = sizes[i];
    layout.strides[i] = strides[i];
  }
  return layout;
}

inline cpu::RowLayout row_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1 && (t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0),
              "fastformer._C: last dimension must be contiguous");
  return leading_layout(t);
}

inline const void* ptr_or_null(const optional<Tensor>& t) {
  const Tensor* p = present(t);
  return p ? p->data_ptr() : nullptr;
}

inline at::ScalarType stats_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A tensor laid out as a contiguous copy of `shape` would be, in x's options.
inline Tensor empty_rows(at::IntArrayRef shape, const Tensor& like) {
  return at::empty(shape, like.options().memory_format(at::MemoryFormat::Contiguous));
}

// Releases the GIL around a kernel when this thread holds it: a call from Python does, the
// autograd engine running a C++ node's backward (AddNormFunction) does not.
class KernelGilRelease {
 public:
  KernelGilRelease() {
    if (PyGILState_Check()) release_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

}  // namespace cpu_bindings
}  // namespace fastformer
