// FFN activations and their derivatives, written once for the CPU (scalar and SIMD) and CUDA
// kernels. With x the pre-activation (GEMM output + bias):
//   relu(x)      = max(x, 0)                         relu'(x)      = 1 if x > 0 else 0
//   gelu(x)      = x/2 (1 + erf(x/sqrt2))            gelu'(x)      = (1 + erf(x/sqrt2))/2
//                                                                   + x exp(-x^2/2)/sqrt(2 pi)
//   gelu_tanh(x) = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//                  gelu_tanh'(x) = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),
//                  t = tanh(u)                       (torch's gelu(approximate="tanh") backward)
//   silu(x)      = x s(x),  s = 1/(1 + exp(-x))      silu'(x)      = s (1 + x (1 - s))
//   quick_gelu(x) = x s(1.702 x)                     quick_gelu'(x) = s (1 + 1.702 x (1 - s)),
//                  s = s(1.702 x)                    (OpenAI CLIP's GELU approximation)
//   relu2(x)     = relu(x)^2                         relu2'(x)     = 2 relu(x)
//                                                    (squared ReLU: Nemotron, Persimmon, Arcee)
// Gated (SwiGLU = silu, GeGLU = gelu / gelu_tanh, ReGLU = relu): h = act(gate) * up, so
//   d gate = dh * up * act'(gate),   d up = dh * act(gate).
// Biased: y = act(x + b), dx = dy * act'(x + b), db = sum over rows of dx.
//
// The templates take a value type V that supports +, -, *, / and construction from a double
// constant (V(0.5)), and call the non-arithmetic functions through ActMath<V>. Scalars (float,
// double) are provided here; a SIMD type (e.g. at::vec::Vectorized<float>) is used by
// specializing ActMath for it, anywhere before the first instantiation:
//   template <> struct fastformer::ActMath<Vec> {
//     static Vec exp(const Vec& x);    // e^x (x = -inf -> 0, large x -> inf)
//     static Vec erf(const Vec& x);
//     static Vec erf_gauss(const Vec& z, Vec& gauss);  // erf(z), and gauss = e^(-z^2) (which
//                                      // erf formulas compute anyway: the GELU's derivative)
//     static Vec tanh(const Vec& x);
//     static Vec relu(const Vec& x);   // x < 0 ? 0 : x  (NaN stays NaN, as torch.relu)
//     static Vec step(const Vec& x);   // x > 0 ? 1 : 0  (relu's derivative, torch's convention)
//   };
// All math is in V's precision; kernels on fp16/bf16 data convert to float first.
#pragma once
#include <math.h>

#include "ff_common.h"

namespace fastformer {

// The numbering is part of the ABI between the bindings and the kernels; keep it stable.
enum class Activation : int32_t { relu = 0, gelu = 1, gelu_tanh = 2, silu = 3, quick_gelu = 4, relu2 = 5 };

template <typename V>
struct ActMath;

template <>
struct ActMath<float> {
  static FF_HOST_DEVICE float exp(float x) { return ::expf(x); }
  static FF_HOST_DEVICE float erf(float x) { return ::erff(x); }
  static FF_HOST_DEVICE float erf_gauss(float z, float& gauss) {
    gauss = ::expf(-z * z);
    return ::erff(z);
  }
  static FF_HOST_DEVICE float tanh(float x) { return ::tanhf(x); }
  static FF_HOST_DEVICE float relu(float x) { return x < 0.f ? 0.f : x; }
  static FF_HOST_DEVICE float step(float x) { return x > 0.f ? 1.f : 0.f; }
};

template <>
struct ActMath<double> {
  static FF_HOST_DEVICE double exp(double x) { return ::exp(x); }
  static FF_HOST_DEVICE double erf(double x) { return ::erf(x); }
  static FF_HOST_DEVICE double erf_gauss(double z, double& gauss) {
    gauss = ::exp(-z * z);
    return ::erf(z);
  }
  static FF_HOST_DEVICE double tanh(double x) { return ::tanh(x); }
  static FF_HOST_DEVICE double relu(double x) { return x < 0.0 ? 0.0 : x; }
  static FF_HOST_DEVICE double step(double x) { return x > 0.0 ? 1.0 : 0.0; }
};

namespace act_const {
constexpr double kInvSqrt2 = 0.70710678118654752440;     // 1/sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1/sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
constexpr double kTanhCubic = 0.044715;
constexpr double kQuickGelu = 1.702;  // quick_gelu's sigmoid scale
}  // namespace act_const

template <typename V>
struct ValueGrad {
  V value;  // act(x)
  V grad;   // act'(x)
};

namespace act_detail {
using namespace act_const;
template <typename V, typename M>
FF_HOST_DEVICE V gelu_cdf(const V& x) {  // Phi(x)
  return V(0.5) * (V(1.0) + M::erf(x * V(kInvSqrt2)));
}
template <typename V, typename M>
FF_HOST_DEVICE V gelu_tanh_t(const V& x, const V& x_sq) {  // tanh(u)
  return M::tanh(V(kSqrt2OverPi) * (x + V(kTanhCubic) * x_sq * x));
}
template <typename V, typename M>
FF_HOST_DEVICE V sigmoid(const V& x) {
  return V(1.0) / (V(1.0) + M::exp(V(0.0) - x));
}
}  // namespace act_detail

// act(x); bit-identical to activation_value_grad(x).value.
template <Activation A, typename V, typename M = ActMath<V>>
FF_HOST_DEVICE V activation(const V& x) {
  using namespace act_detail;
  if constexpr (A == Activation::relu) {
    return M::relu(x);
  } else if constexpr (A == Activation::gelu) {
    return x * gelu_cdf<V, M>(x);
  } else if constexpr (A == Activation::gelu_tanh) {
    return (V(0.5) * x) * (V(1.0) + gelu_tanh_t<V, M>(x, x * x));
  } else if constexpr (A == Activation::quick_gelu) {
    return x * sigmoid<V, M>(V(kQuickGelu) * x);
  } else if constexpr (A == Activation::relu2) {
    const V r = M::relu(x);
    return r * r;
  } else {
    return x * sigmoid<V, M>(x);
  }
}

// act(x) and act'(x), sharing the transcendental functions.
template <Activation A, typename V, typename M = ActMath<V>>
FF_HOST_DEVICE ValueGrad<V> activation_value_grad(const V& x) {
  using namespace act_detail;
  if constexpr (A == Activation::relu) {
    return {M::relu(x), M::step(x)};
  } else if constexpr (A == Activation::gelu) {
    V gauss;  // e^(-x^2 / 2)
    const V cdf = V(0.5) * (V(1.0) + M::erf_gauss(x * V(kInvSqrt2), gauss));
    const V pdf = V(kInvSqrt2Pi) * gauss;
    return {x * cdf, cdf + x * pdf};
  } else if constexpr (A == Activation::gelu_tanh) {
    const V x_sq = x * x;
    const V t = gelu_tanh_t<V, M>(x, x_sq);
    const V half_x = V(0.5) * x;
    const V du_dx = V(kSqrt2OverPi) * (V(1.0) + V(3.0 * kTanhCubic) * x_sq);
    return {half_x * (V(1.0) + t), V(0.5) * (V(1.0) + t) + half_x * (V(1.0) - t * t) * du_dx};
  } else if constexpr (A == Activation::quick_gelu) {
    const V kx = V(kQuickGelu) * x;
    const V s = sigmoid<V, M>(kx);
    return {x * s, s * (V(1.0) + kx * (V(1.0) - s))};
  } else if constexpr (A == Activation::relu2) {
    const V r = M::relu(x);
    return {r * r, V(2.0) * r};
  } else {
    const V s = sigmoid<V, M>(x);
    return {x * s, s * (V(1.0) + x * (V(1.0) - s))};
  }
}

// Call f(std::integral_constant-like tag) with the compile-time Activation named by `a`:
//   dispatch_activation(a, [&](auto tag) { kernel<decltype(tag)::value>(...); });
template <Activation A>
struct ActivationTag {
  static constexpr Activation value = A;
};

template <typename F>
inline void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::relu: f(ActivationTag<Activation::relu>{}); break;
    case Activation::gelu: f(ActivationTag<Activation::gelu>{}); break;
    case Activation::gelu_tanh: f(ActivationTag<Activation::gelu_tanh>{}); break;
    case Activation::quick_gelu: f(ActivationTag<Activation::quick_gelu>{}); break;
    case Activation::relu2: f(ActivationTag<Activation::relu2>{}); break;
    default: f(ActivationTag<Activation::silu>{}); break;
  }
}

}  // namespace fastformer
