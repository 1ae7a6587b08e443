// Attention score softcapping (Gemma 2), shared by the CPU and CUDA kernels:
//   s' = c * tanh(s / c)      (c > 0; s the scaled score, before the biases and masks)
//   ds/ds' factor = 1 - tanh(s / c)^2    (the backward multiplies dS by it before dQ, dK)
//
// tanh is computed from one exp2 rather than by tanhf: nvcc --use_fast_math turns tanhf into
// tanh.approx.f32, whose relative error of up to 2^-11 is 0.015 on a logit capped at 30 (more
// than one fp16 rounding of the score). This form is odd-symmetric, exactly +-1 for large |x|,
// and off by at most ~3e-7 absolute everywhere (the cancellation in 1 - e near 0 costs relative
// accuracy there, never absolute accuracy, which is what the softmax sees). On a GPU it is two
// MUFU operations (ex2, rcp) instead of one.
#pragma once
#include <math.h>

#include "ff_common.h"

namespace fastformer {

// tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|) in (0, 1].
template <typename T>
FF_HOST_DEVICE T softcap_tanh(T x) {
  const T e = static_cast<T>(exp2(T(-2.0 * 1.4426950408889634) * fabs(x)));
  return static_cast<T>(copysign((T(1) - e) / (T(1) + e), x));
}

// d/ds of c * tanh(s / c), from t = tanh(s / c).
template <typename T>
FF_HOST_DEVICE T softcap_grad(T t) {
  return T(1) - t * t;
}

}  // namespace fastformer
