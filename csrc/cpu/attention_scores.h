// Attention's score rows on CPU (semantics: fastformer/reference/attention.py): S = Q K^T of
// one query row against one key block, turned into log2-unit scores (scale, softcap, ALiBi and
// the relative bias, masks and the band's edges: score_row), exponentiated against the row's
// shift (exp2_row), and in the backward P and dS of a row in one pass (p_ds_row). Everything
// works in place on a row of the score tile (kBlockK + slack floats, in L1); the per-row extras
// are the bias row (bias_row, Bk_pad floats) and, per call, the TermsTable (B * H * (Lq + Lk)
// floats at most). The forward (attention_fwd.cpp), the backward (attention_bwd.cpp) and
// decoding (attention_decode.cpp) call the same functions, so the backward's P is the forward's.
#pragma once

#include "cpu/attention_common.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace attn {

// Scores are kept in log2 units (exp2 is cheaper): fastformer::kLog2e, common/online_softmax.h.

// max_nan_from_first, exp2_nonpositive, fast_tanh: cpu/vec_math.h.

// S = Q K^T (one vector of a row) to log2-unit scores plus `bias`: mul * S + bias, or with
// softcap cap_out * tanh(cap_in * S) + bias (Shape::cap, one rounding of the sum: an explicit
// FMA, the same on every compiler); d_cap (the backward's, may be null) gets 1 - tanh^2, the
// derivative of the capped score by the uncapped one.
template <typename A>
inline Vectorized<A> transform_scores(const Shape<A>& sh, const Vectorized<A>& S, const Vectorized<A>& mul,
                                      const Vectorized<A>& bias, A* d_cap) {
  using V = Vectorized<A>;
  if (sh.cap_out == A(0)) return at::vec::fmadd(S, mul, bias);
  if (!d_cap) return sh.cap(S, bias);
  V d;
  const V x = sh.cap(S, bias, &d);
  d.store(d_cap);
  return x;
}

// The additive terms of one score row, log2 units: ALiBi's -slope * |qi + d - (k0 + j)| (the
// distance as lanes, exact in fp32 below 2^24) plus the relative bias rel_bias[h, k0 + j - qi +
// Lq - 1] (a contiguous slice of the head's vector per row; the bindings pad the vector by
// kRelSlack columns for the padding columns' reads). Both depend on j - i only: a call's
// TermsTable computes them once per (b, h) over j - i and at() reads the row's slice; without
// one (decoding) at() computes them, by the same instructions (the same bits).
template <typename A>
struct InlineBias {
  Vectorized<A> neg_slope, origin, iota;
  const A* rel = nullptr;    // the row's slice: entry j is key k0 + j's bias (log2 units: * log2e)
  const A* table = nullptr;  // the row's slice of the call's TermsTable
  InlineBias(const AttnArgs& a, const Shape<A>& sh, int64_t b, int64_t h, int64_t qi, int64_t k0)
      : neg_slope(a.alibi_slopes ? -static_cast<A>(kLog2e) *
                                       static_cast<A>(a.alibi_slopes[b * a.alibi_s[0] + h * a.alibi_s[1]])
                                 : A(0)),
        origin(static_cast<A>(qi + sh.diag - k0)), iota(Vectorized<A>::arange(A(0), A(1))) {
    if (sh.terms) table = sh.terms + b * sh.terms_bs + h * sh.terms_ld + (k0 - qi + sh.Lq - 1);
    if (a.rel_bias)
      rel = static_cast<const A*>(a.rel_bias) + h * (sh.Lq + sh.Lk - 1 + kRelSlack) + (k0 - qi + sh.Lq - 1);
  }
  Vectorized<A> at(const Shape<A>& sh, int64_t j0) const {
    using V = Vectorized<A>;
    if (table) return V::loadu(table + j0);
    V x = sh.alibi ? neg_slope * (origin - (iota + V(static_cast<A>(j0)))).abs() : V(A(0));
    if (sh.rel) x = at::vec::fmadd(V::loadu(rel + j0), V(static_cast<A>(kLog2e)), x);
    return x;
  }
};

// ALiBi's and the relative bias's terms of a call, once per (b, h) (per h when the slopes are
// (H,)) over n = j - i + Lq - 1: InlineBias::at of the row qi = Lq - 1 at k0 = 0, whose entry j
// is n = j. Per score, reading it is one load where computing ALiBi's term took four vector
// instructions (a bf16 ALiBi forward at (1, 8, 2048, 64) on the 2-core AMX Xeon spent its extra
// time over the plain call in that work); B * H * (Lq + Lk) values at most.
template <typename A>
struct TermsTable {
  std::vector<A> values;
  std::vector<A> maxima;  // per vector, its largest entry (a bound on any row's terms)
  TermsTable(const AttnArgs& a, Shape<A>& sh) {
    if (!sh.alibi && !sh.rel) return;
    using V = Vectorized<A>;
    const int64_t ld = round_up_to(sh.Lq + sh.Lk - 1 + kRelSlack, V::size());
    const int64_t n_b = a.alibi_slopes && a.alibi_s[0] != 0 ? sh.B : 1;
    values.assign(n_b * sh.H * ld, A(0));
    maxima.assign(n_b * sh.H, A(0));
    const int64_t filled = round_up_to(sh.Lq + sh.Lk - 1, V::size());  // <= ld - kRelSlack + V::size()
    for (int64_t b = 0; b < n_b; ++b)
      for (int64_t h = 0; h < sh.H; ++h) {
        const InlineBias<A> row(a, sh, b, h, sh.Lq - 1, 0);
        A* out = values.data() + (b * sh.H + h) * ld;
        for (int64_t j = 0; j < filled; j += V::size()) row.at(sh, j).store(out + j);
        maxima[b * sh.H + h] = *std::max_element(out, out + ld);  // (NaN entries: their scores are NaN)
      }
    sh.terms = values.data();
    sh.terms_ld = ld;
    sh.terms_bs = n_b > 1 ? sh.H * ld : 0;
    sh.terms_max = maxima.data();
  }
};

// The additive bias of one row over the visible keys [lo, hi) of [k0, k0 + cols), in log2
// units, -inf elsewhere and where a bool mask or the key padding excludes a key, plus the
// float mask.
template <typename A>
inline void bias_row(const AttnArgs& a, const Shape<A>& sh, int64_t b, int64_t h, int64_t qi, int64_t k0,
                     int64_t lo, int64_t hi, int64_t cols, A* bias) {
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  const A log2e = static_cast<A>(kLog2e);
  std::fill(bias, bias + lo, kNegInf<A>);
  std::fill(bias + lo, bias + hi, A(0));
  std::fill(bias + hi, bias + cols, kNegInf<A>);
  if (a.key_padding_mask) {
    const bool* pad = a.key_padding_mask + b * a.kpm_s[0] + k0 * a.kpm_s[1];
    for (int64_t j = lo; j < hi; ++j)
      if (pad[j * a.kpm_s[1]]) bias[j] = kNegInf<A>;
  }
  if (a.attn_mask.ptr) {
    const int64_t off = b * a.attn_mask.s[0] + h * a.attn_mask.s[1] + qi * a.attn_mask.s[2] +
                        k0 * a.attn_mask.s[3];
    const int64_t step = a.attn_mask.s[3];
    if (a.mask_is_bool) {
      const bool* m = static_cast<const bool*>(a.attn_mask.ptr) + off;
      int64_t j = lo;
      // 8 bools (bytes, 0 or 1) at a time: a materialized band or causal mask is mostly runs of
      // one value (per element, this loop was ~60% of a (1, 8, 4096, 64) band-mask forward).
      for (; step == 1 && j + 8 <= hi; j += 8) {
        if (bools8(m + j) == kTrueBools8) continue;
        for (int64_t e = j; e < j + 8; ++e)
          if (!m[e]) bias[e] = kNegInf<A>;
      }
      for (; j < hi; ++j)
        if (!m[j * step]) bias[j] = kNegInf<A>;
    } else {
      dispatch_dtype(a.mask_dtype, [&](auto tag) {
        using M = decltype(tag);
        const M* m = static_cast<const M*>(a.attn_mask.ptr) + off;
        for (int64_t j = lo; j < hi; ++j) bias[j] += log2e * static_cast<A>(static_cast<acc_t<M>>(m[j * step]));
      });
    }
  }
}

// The vectors j = 0, kV, .. < cols of a score row by where they fall against its visible keys
// [lo, hi): outside(j) for those wholly outside, visit(j, std::false_type{}) for those wholly
// inside (a body without the edge tests) and visit(j, std::true_type{}) for those an edge cuts.
template <int64_t kV, class Outside, class Visit>
inline void for_row_vectors(int64_t lo, int64_t hi, int64_t cols, const Outside& outside, const Visit& visit) {
  int64_t j = 0;
  for (; j + kV <= lo; j += kV) outside(j);
  for (; j < hi && (j < lo || j + kV > hi); j += kV) visit(j, std::true_type{});
  for (; j + kV <= hi; j += kV) visit(j, std::false_type{});
  for (; j < hi; j += kV) visit(j, std::true_type{});
  for (; j < cols; j += kV) outside(j);
}

// Scores of one row, in place over [0, cols) (cols = Shape::block_cols(n_keys)), in log2 units:
// s_j = transform(S_j) (mul * S_j, or softcapped) + the row's bias (bias_row), -inf where a
// mask, the band (when `cut`: the tile is cut by an edge, Shape::cut) or the end of the keys
// (j >= n_keys; keys k0 .. k0 + n_keys of query qi) excludes the key. mul is scale * log2(e)
// (Q K^T comes unscaled from the GEMM in both passes). bias: a row of scratch; d_cap (the
// backward's, with softcap) gets 1 - tanh^2 per entry. Both Bk_pad + one vector long. Returns
// the row max, NaN scores skipped (-inf if no key is allowed; a NaN's P is NaN anyway).
// bias_ready: bias already holds this row's bias row (Shape::shared_bias tiles after their
// first row).
template <typename A>
inline A score_row(const AttnArgs& a, const Shape<A>& sh, A* s, A mul, int64_t b, int64_t h, int64_t qi,
                   int64_t k0, int64_t n_keys, int64_t cols, bool cut, A* bias, A* d_cap = nullptr,
                   bool bias_ready = false) {
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  const int64_t lo = cut ? sh.lo_begin(qi, k0, n_keys) : 0;       // visible keys [lo, hi)
  const int64_t hi = cut ? sh.hi_end(qi, k0, n_keys) : n_keys;
  const V mul_v(mul), neg_inf(kNegInf<A>);
  V row_max(kNegInf<A>);
  const bool inline_terms = sh.alibi || sh.rel;
  if (!sh.bias_row && !inline_terms && sh.cap_out == A(0)) {  // (d_cap is null without softcap)
    // Only the band and the padding columns (a causal or windowed tile, the most common cut):
    // mul * S on the vectors that touch [lo, hi), -inf on the others. Its own loop: with the
    // general one below (the option tests per vector, InlineBias per row) the causal fp32
    // forward at (8, 12, 128, 64) took 3.82 ms instead of 3.48 on one thread (2-core Zen 5,
    // six alternating rounds of 300-call medians).
    const V iota = V::arange(A(0), A(1)), lo_v(static_cast<A>(lo)), hi_v(static_cast<A>(hi));
    int64_t j = 0;
    for (; j + kV <= lo; j += kV) neg_inf.store(s + j);
    for (; j < hi; j += kV) {
      V x = V::loadu(s + j) * mul_v;
      if (j < lo || j + kV > hi) {
        const V idx = iota + V(static_cast<A>(j));
        x = V::blendv(neg_inf, x, (idx >= lo_v) & (idx < hi_v));
      }
      x.store(s + j);
      row_max = max_nan_from_first(row_max, x);
    }
    for (; j < cols; j += kV) neg_inf.store(s + j);
    return reduce_max_no_nan(row_max);
  }
  const InlineBias<A> inline_bias(a, sh, b, h, qi, k0);
  if (!sh.bias_row) {
    // The band and the padding columns with softcap or the inline terms: transformed scores
    // on [lo, hi), -inf elsewhere (entries the causal tile GEMMs left unwritten included),
    // without a bias row. Vectors wholly inside [lo, hi) (all of an uncut tile's) run without
    // the edge tests (with reduce_max_no_nan, score_row went from 19.5% to 11.6% of a
    // softcapped bf16 (1, 8, 2048, 64) forward's perf samples).
    const V iota = V::arange(A(0), A(1)), lo_v(static_cast<A>(lo)), hi_v(static_cast<A>(hi));
    const auto outside = [&](int64_t j) {
      neg_inf.store(s + j);
      if (d_cap) V(A(0)).store(d_cap + j);
    };
    const auto inside = [&](int64_t j, auto edge_flag) {  // edge: a compile-time flag
      V x = transform_scores(sh, V::loadu(s + j), mul_v, inline_terms ? inline_bias.at(sh, j) : V(A(0)),
                             d_cap ? d_cap + j : nullptr);
      if constexpr (decltype(edge_flag)::value) {
        const V idx = iota + V(static_cast<A>(j));
        x = V::blendv(neg_inf, x, (idx >= lo_v) & (idx < hi_v));
      }
      x.store(s + j);
      row_max = max_nan_from_first(row_max, x);
    };
    for_row_vectors<kV>(lo, hi, cols, outside, inside);
    return reduce_max_no_nan(row_max);
  }
  // The band's tile GEMMs (Band::kColsUpTo) may have left entries outside [lo, hi) unwritten.
  if (cut) {
    std::fill(s, s + lo, A(0));
    std::fill(s + hi, s + cols, A(0));
  }
  if (!bias_ready) bias_row(a, sh, b, h, qi, k0, lo, hi, cols, bias);
  for (int64_t j = 0; j < cols; j += kV) {
    const V extra = inline_terms ? V::loadu(bias + j) + inline_bias.at(sh, j) : V::loadu(bias + j);
    const V x = transform_scores(sh, V::loadu(s + j), mul_v, extra, d_cap ? d_cap + j : nullptr);
    x.store(s + j);
    row_max = max_nan_from_first(row_max, x);
  }
  return reduce_max_no_nan(row_max);
}

// The backward's P and dS of one row in one pass, for rows with no bias row and no dropout
// (band, padding columns, softcap, ALiBi and the relative bias): p holds S = Q K^T and ds holds
// dP = dO V^T on entry; on return p_j = 2^(s_j - lse2) with s_j exactly as score_row scores it
// (so P is the forward's), dS_j = P_j (dP_j - delta) (1 - tanh^2 with softcap), both 0 outside
// the row's visible keys [lo, hi) (entries the band's GEMMs left unwritten included). d_rel
// (may be null): the row's slice of the relative bias's gradient, which gets dS before the
// softcap factor. Replaces score_row + exp2_row + the dS pass + the softcap factor's pass.
template <typename A>
inline void p_ds_row(const AttnArgs& a, const Shape<A>& sh, A* p, A* ds, A mul, int64_t b, int64_t h, int64_t qi,
                     int64_t k0, int64_t n_keys, int64_t cols, bool cut, A lse2, A delta, A* d_rel) {
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  const int64_t lo = cut ? sh.lo_begin(qi, k0, n_keys) : 0;
  const int64_t hi = cut ? sh.hi_end(qi, k0, n_keys) : n_keys;
  const InlineBias<A> inline_bias(a, sh, b, h, qi, k0);
  const bool inline_terms = sh.alibi || sh.rel;
  const V mul_v(mul), neg_shift(-lse2), delta_v(delta), zero(A(0)), neg_inf(kNegInf<A>);
  const V iota = V::arange(A(0), A(1)), lo_v(static_cast<A>(lo)), hi_v(static_cast<A>(hi));
  const bool capped = sh.cap_out != A(0);
  if (sh.cap_fused(cut, n_keys, cols)) {
    // P = 2^(cap(S) - lse2) with one rounding (as the forward's on-the-fly exp pass); no edge,
    // no terms. Its own loop: the cap's coefficients a local copy (in registers: the stores to
    // p and ds may alias the Shape's) and the polynomial's degree fixed outside the loop.
    const ScaledTanh<A> cap = sh.cap;
    cap.with_degree([&](auto long_poly) {
      for (int64_t j = 0; j < cols; j += kV) {
        V d_cap;
        const V p_v = exp2_nonpositive(cap.template apply<long_poly>(V::loadu(p + j), neg_shift, &d_cap));
        p_v.store(p + j);
        (p_v * (V::loadu(ds + j) - delta_v) * d_cap).store(ds + j);
      }
    });
    return;
  }
  // One vector of keys; `edge` (a compile-time flag): it holds keys outside [lo, hi). The
  // vectors wholly inside run without the band tests (as score_row's).
  const auto one = [&](int64_t j, auto edge_flag) {
    constexpr bool edge = decltype(edge_flag)::value;
    const V S = V::loadu(p + j);
    V in_band;
    if constexpr (edge) {
      const V idx = iota + V(static_cast<A>(j));
      in_band = (idx >= lo_v) & (idx < hi_v);
    }
    V d_cap;
    const V terms = inline_terms ? inline_bias.at(sh, j) : zero;
    V x = capped         ? sh.cap(S, terms, &d_cap)
          : inline_terms ? at::vec::fmadd(S, mul_v, terms)
                         : S * mul_v;  // (as score_row's band-only loop)
    if constexpr (edge) x = V::blendv(neg_inf, x, in_band);
    const V p_v = exp2_nonpositive(at::vec::fmadd(x, V(A(1)), neg_shift));
    V ds_v = p_v * (V::loadu(ds + j) - delta_v);
    if constexpr (edge) ds_v = V::blendv(zero, ds_v, in_band);
    if (d_rel) (V::loadu(d_rel + j) + ds_v).store(d_rel + j);
    if (capped) {
      ds_v = ds_v * d_cap;  // d_cap of unwritten lanes may be NaN: blend again
      if constexpr (edge) ds_v = V::blendv(zero, ds_v, in_band);
    }
    p_v.store(p + j);
    ds_v.store(ds + j);
  };
  const auto outside = [&](int64_t j) {
    zero.store(p + j);
    zero.store(ds + j);
  };
  for_row_vectors<kV>(lo, hi, cols, outside, one);
}

// p_j = 2^(mul * s_j - shift) in place over [0, n_pad), with one rounding (an FMA); returns the
// sum. mul = 1 for scores score_row has already scaled. Rows no mask touches pass the GEMM's
// Q K^T with mul = scale * log2(e) in both passes, so the forward and the backward compute P
// from bitwise the same S by the same formula (the saved lse and output match the backward's
// P), and mul * s is never rounded at the scores' magnitude: with Q prescaled instead, scores
// ~200 lost ~1e-5 per entry, and the backward's dq disagreed with the forward by 2e-4.
template <typename A>
inline A exp2_row(A* s, int64_t n_pad, A shift, A mul = A(1)) {
  using V = Vectorized<A>;
  const V mul_v(mul), neg_shift(-shift);
  V sum(A(0));
  for (int64_t j = 0; j < n_pad; j += V::size()) {
    const V p = exp2_nonpositive(at::vec::fmadd(V::loadu(s + j), mul_v, neg_shift));
    p.store(s + j);
    sum = sum + p;
  }
  return reduce_add(sum);
}

// exp2_row (mul = 1) of a row whose scores are -inf outside [lo, hi) (score_row on a tile an
// edge cuts: a causal diagonal's or a window's): the vectors wholly outside are zeroed without
// an exp. The same P and sum bit for bit (the vectors kept sit in the same lanes, and adding a
// zero vector leaves the sum as it is). Measured in attention_fwd.cpp's query_block.
template <typename A>
inline A exp2_row_band(A* s, int64_t n_pad, int64_t lo, int64_t hi, A shift) {
  constexpr int64_t kV = Vectorized<A>::size();
  const int64_t j_lo = std::min(n_pad, lo / kV * kV), j_hi = std::clamp<int64_t>(round_up_to(hi, kV), j_lo, n_pad);
  std::fill(s, s + j_lo, A(0));
  std::fill(s + j_hi, s + n_pad, A(0));
  return j_hi > j_lo ? exp2_row(s + j_lo, j_hi - j_lo, shift) : A(0);
}

// Maximum of a row of n_pad values (a multiple of the vector width).
template <typename A>
inline A row_max_of(const A* s, int64_t n_pad) {
  using V = Vectorized<A>;
  V max_v(kNegInf<A>);
  for (int64_t j = 0; j < n_pad; j += V::size()) max_v = max_nan_from_first(max_v, V::loadu(s + j));
  return reduce_max_no_nan(max_v);
}

// Zeroes the dropped probabilities of one row (keys k0 .. k0 + n_keys of query qi).
template <typename A>
inline void drop_row(const AttnArgs& a, A* p, int64_t b, int64_t h, int64_t qi, int64_t k0,
                     int64_t n_keys, uint32_t threshold) {
  const uint64_t base = a.offset + static_cast<uint64_t>(((b * a.H + h) * a.Lq + qi) * a.Lk + k0);
  uint32_t words[kBlockK];
  philox_words(base, a.seed, n_keys, words);
  zero_dropped(words, n_keys, threshold, p);
}

}  // namespace attn
}  // namespace fastformer::cpu::CPU_CAPABILITY
