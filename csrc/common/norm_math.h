// Per-element math of LayerNorm / RMSNorm, forward and backward, shared by every C++/CUDA kernel.
//
// Forward, per row z (= x + residual) of length N:
//   LayerNorm: mean = sum(z)/N, var = sum((z-mean)^2)/N, rstd = 1/sqrt(var + eps)
//              x_hat = (z - mean) * rstd,  y = x_hat * w + b
//   RMSNorm:   mean := 0,  rstd = 1/sqrt(sum(z^2)/N + eps),  x_hat = z * rstd,  y = x_hat * w
//
// Backward, with g = dy * w (w = 1 when absent):
//   c_xhat = sum(g * x_hat)/N,   c_g = sum(g)/N          (c_g := 0 for RMSNorm)
//   dz = (g - x_hat * c_xhat - c_g) * rstd
//   dw = sum over rows of dy * x_hat,  db = sum over rows of dy
// Only mean and rstd (fp32, fp64 for fp64 inputs) are saved; x_hat is recomputed from z.
//
// Templates are instantiated with scalars (CUDA, scalar tails) and with SIMD vectors (CPU).
#pragma once
#include "ff_common.h"

namespace fastformer {

template <typename V>
FF_HOST_DEVICE V norm_x_hat(const V& z, const V& mean, const V& rstd) {
  return (z - mean) * rstd;
}

template <typename V>
FF_HOST_DEVICE V norm_affine(const V& x_hat, const V& w, const V& b) {
  return x_hat * w + b;
}

template <typename V>
FF_HOST_DEVICE V norm_dz(const V& g, const V& x_hat, const V& c_xhat, const V& c_g,
                         const V& rstd) {
  return (g - x_hat * c_xhat - c_g) * rstd;
}

}  // namespace fastformer
