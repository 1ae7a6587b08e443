// Evaluates the shared host/device math of csrc/common on inputs given on stdin, for
// tests/test_common_math.py (which compares against torch / numpy / reference/rng.py).
// One command per line; each prints one line of space-separated results (%.17g):
//   act KIND TYPE N x_1..x_N       KIND 0..5 (Activation), TYPE f|d|v (float, double, a 4-lane
//                                  vector type through a user ActMath specialization):
//                                  value_1 grad_1 ... value_N grad_N, and activation<A>(x) == value
//   softmax TYPE DOMAIN COLS BLOCK s_1..s_COLS v_1..v_COLS
//                                  online softmax over blocks of BLOCK scores (DOMAIN e: exp,
//                                  2: exp2 with log2(e) folded in): lse out (out = sum_j p_j v_j)
//   philox SEED N c_1..c_N         philox_word(c_i, SEED)
//   philox_run SEED BASE N         words of base..base+N-1 from cpu/philox_vec.h's batched
//                                  generator (its AVX2 lanes when compiled with -mavx2)
//   threshold P                    dropout_threshold(P)
//   welford N_CHUNKS len_1 x.. len_2 x.. ...   push each chunk, welford_merge the chunks:
//                                  count mean m2
//   welford_equal K COUNT x_1..x_{K*COUNT}     K equal chunks merged with welford_merge_equal:
//                                  count mean m2
#include <stdio.h>

#include <iostream>
#include <string>
#include <vector>

#include "common/activations.h"
#include "common/online_softmax.h"
#include "common/philox.h"
#include "common/welford.h"
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif
#include "cpu/philox_vec.h"

using namespace fastformer;

// A minimal SIMD-like type: what a CPU kernel's Vectorized<float> looks like to activations.h.
struct Vec4 {
  float v[4];
  Vec4() = default;
  Vec4(double c) { v[0] = v[1] = v[2] = v[3] = static_cast<float>(c); }  // NOLINT: broadcast
};
#define VEC4_OP(op)                                        \
  inline Vec4 operator op(const Vec4& a, const Vec4& b) {  \
    Vec4 r;                                                \
    for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] op b.v[i]; \
    return r;                                              \
  }
VEC4_OP(+)
VEC4_OP(-)
VEC4_OP(*)
VEC4_OP(/)

template <>
struct fastformer::ActMath<Vec4> {
  template <typename F>
  static Vec4 map(const Vec4& x, F f) {
    Vec4 r;
    for (int i = 0; i < 4; ++i) r.v[i] = f(x.v[i]);
    return r;
  }
  static Vec4 exp(const Vec4& x) { return map(x, ActMath<float>::exp); }
  static Vec4 erf(const Vec4& x) { return map(x, ActMath<float>::erf); }
  static Vec4 erf_gauss(const Vec4& z, Vec4& gauss) {
    for (int i = 0; i < 4; ++i) gauss.v[i] = ActMath<float>::exp(-z.v[i] * z.v[i]);
    return erf(z);
  }
  static Vec4 tanh(const Vec4& x) { return map(x, ActMath<float>::tanh); }
  static Vec4 relu(const Vec4& x) { return map(x, ActMath<float>::relu); }
  static Vec4 step(const Vec4& x) { return map(x, ActMath<float>::step); }
};

namespace {

void print(double v) { printf("%.17g ", v); }

template <Activation A, typename V>
void act_scalars(const std::vector<double>& xs) {
  for (double x : xs) {
    const ValueGrad<V> r = activation_value_grad<A>(static_cast<V>(x));
    if (activation<A>(static_cast<V>(x)) != r.value && r.value == r.value) {
      fprintf(stderr, "activation() and activation_value_grad() disagree at %g\n", x);
    }
    print(r.value);
    print(r.grad);
  }
}

template <Activation A>
void act_vec4(const std::vector<double>& xs) {
  for (size_t i = 0; i < xs.size(); i += 4) {
    Vec4 x;
    for (int l = 0; l < 4; ++l) x.v[l] = static_cast<float>(i + l < xs.size() ? xs[i + l] : 0.0);
    const ValueGrad<Vec4> r = activation_value_grad<A>(x);
    for (int l = 0; l < 4 && i + l < xs.size(); ++l) {
      print(r.value.v[l]);
      print(r.grad.v[l]);
    }
  }
}

template <typename T>
void online_softmax(bool log2_domain, size_t block, const std::vector<double>& s,
                    const std::vector<double>& v) {
  T m = -INFINITY, l = 0, acc = 0;
  for (size_t b0 = 0; b0 < s.size(); b0 += block) {
    const size_t b1 = std::min(s.size(), b0 + block);
    T block_max = -INFINITY;
    for (size_t j = b0; j < b1; ++j) {
      const T x =
          log2_domain ? static_cast<T>(s[j]) * static_cast<T>(kLog2e) : static_cast<T>(s[j]);
      block_max = std::max(block_max, x);
    }
    const T m_new = std::max(m, block_max);
    const T alpha =
        log2_domain ? online_softmax_alpha_log2(m, m_new) : online_softmax_alpha(m, m_new);
    const T shift = softmax_shift(m_new);
    T p_sum = 0, pv_sum = 0;
    for (size_t j = b0; j < b1; ++j) {
      const T x =
          log2_domain ? static_cast<T>(s[j]) * static_cast<T>(kLog2e) : static_cast<T>(s[j]);
      const T p = log2_domain ? static_cast<T>(exp2(x - shift)) : static_cast<T>(exp(x - shift));
      p_sum += p;
      pv_sum += p * static_cast<T>(v[j]);
    }
    l = alpha * l + p_sum;
    acc = alpha * acc + pv_sum;
    m = m_new;
  }
  print(log2_domain ? softmax_lse_log2(m, l) : softmax_lse(m, l));
  print(acc * softmax_inv_sum(l));
}

std::vector<double> read_doubles(std::istream& in, size_t n) {
  std::vector<double> xs(n);
  for (double& x : xs) {
    std::string tok;  // "inf" / "-inf" / "nan" as Python prints them
    in >> tok;
    x = std::stod(tok);
  }
  return xs;
}

}  // namespace

int main() {
  std::string cmd;
  while (std::cin >> cmd) {
    if (cmd == "act") {
      int kind;
      char type;
      size_t n;
      std::cin >> kind >> type >> n;
      const std::vector<double> xs = read_doubles(std::cin, n);
      dispatch_activation(static_cast<Activation>(kind), [&](auto tag) {
        constexpr Activation A = decltype(tag)::value;
        if (type == 'f')
          act_scalars<A, float>(xs);
        else if (type == 'd')
          act_scalars<A, double>(xs);
        else
          act_vec4<A>(xs);
      });
    } else if (cmd == "softmax") {
      char type, domain;
      size_t cols, block;
      std::cin >> type >> domain >> cols >> block;
      const std::vector<double> s = read_doubles(std::cin, cols), v = read_doubles(std::cin, cols);
      if (type == 'f')
        online_softmax<float>(domain == '2', block, s, v);
      else
        online_softmax<double>(domain == '2', block, s, v);
    } else if (cmd == "philox") {
      unsigned long long seed, c;
      size_t n;
      std::cin >> seed >> n;
      for (size_t i = 0; i < n; ++i) {
        std::cin >> c;
        printf("%u ", philox_word(c, seed));
      }
    } else if (cmd == "philox_run") {
      unsigned long long seed, base;
      size_t n;
      std::cin >> seed >> base >> n;
      std::vector<uint32_t> words(n);
      fastformer::cpu::CPU_CAPABILITY::philox_words(base, seed, static_cast<int64_t>(n), words.data());
      for (uint32_t w : words) printf("%u ", w);
    } else if (cmd == "threshold") {
      double p;
      std::cin >> p;
      printf("%u ", dropout_threshold(p));
    } else if (cmd == "welford") {
      size_t chunks;
      std::cin >> chunks;
      WelfordState<double> total{0, 0, 0};
      for (size_t c = 0; c < chunks; ++c) {
        size_t len;
        std::cin >> len;
        WelfordState<double> st{0, 0, 0};
        for (double x : read_doubles(std::cin, len)) {
          st.count += 1;
          welford_push(st.mean, st.m2, x, 1.0 / st.count);
        }
        total = welford_merge(total, st);
      }
      print(total.count);
      print(total.mean);
      print(total.m2);
    } else if (cmd == "welford_equal") {
      size_t k, count;
      std::cin >> k >> count;
      std::vector<WelfordState<double>> lanes(k, WelfordState<double>{0, 0, 0});
      for (auto& st : lanes) {
        for (double x : read_doubles(std::cin, count)) {
          st.count += 1;
          welford_push(st.mean, st.m2, x, 1.0 / st.count);
        }
      }
      double mean = 0, sum_m2 = 0, sum_sq_dev = 0;
      for (const auto& st : lanes) mean += st.mean / k;
      for (const auto& st : lanes) {
        sum_m2 += st.m2;
        sum_sq_dev += (st.mean - mean) * (st.mean - mean);
      }
      const WelfordState<double> r =
          welford_merge_equal<double>(count, k, mean, sum_m2, sum_sq_dev);
      print(r.count);
      print(r.mean);
      print(r.m2);
    } else {
      fprintf(stderr, "unknown command %s\n", cmd.c_str());
      return 2;
    }
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
