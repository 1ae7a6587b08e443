// Flash attention forward on CPU (semantics: fastformer/reference/attention.py).
//
// K is packed into fp32 K^T blocks and V into fp32 column panels (attention_common.h), one read
// of K and V per head, in one of two task layouts (handed out dynamically: causal tiles differ
// in cost):
//   - small heads or narrow windows (the key blocks a query block sees <= 1 MB packed) and >= 4
//     heads per thread: a task is a head; it runs its query blocks, packing each key block into
//     its thread's buffers when the first query block that sees it runs (they stay in L2; with
//     GQA each query head repacks its kv head);
//   - else: every (batch, kv head) is packed up front, in parallel, and a task is (batch, head,
//     block of kBlockQ = 144 queries) reading the shared packed blocks.
// Per query block: Q -> fp32 MR-row panels (the S GEMM streams them sequentially);
// row_max = -inf, row_sum = 0; for each key block the queries can see (blocks above the causal
// diagonal are skipped, not masked; inside a tile the diagonal cuts, the GEMMs skip the
// micro-tiles wholly above it, see Band in gemm.h; tiles a bool mask or the key padding
// excludes wholly are skipped too, attention_mask_structure.h):
//   S = Q_tile K^T_block                       micro-kernel GEMM, 2*144*192*D flops
//   s = scale * log2(e) * S (+ log2(e) * float mask, -inf where masked): log2 units; online
//   softmax update (common/online_softmax.h, its log2-unit helpers)
//   P = 2^(s - row_max'), one FMA from S where no mask touches the tile (exactly as the
//   backward recomputes it, see exp2_row), the softcap / ALiBi / relative-bias scores
//   computed in the max and exp passes where only those touch it (OnTheFlyScores), else
//   from score_row's stored scores; dropped entries zeroed (Philox, common/philox.h)
//   acc = alpha * acc + P V_block               micro-kernel GEMM, 2*144*192*Dv flops
//                                               (the first block writes acc: acc = P V_block)
// out = acc / (row_sum * (1 - p)), lse = row_max + log(row_sum) (+inf for fully masked rows).
// Memory per task: reads its Q block once and every visible packed K/V block (L2-resident for
// a head at moderate Lk); writes its out block and lse once. The Lq x Lk matrix never exists:
// the S tile (144 x 192 fp32 = 108 KB) is the only score storage.
// bf16 at the AVX-512 level with AMX-BF16 or AVX512-BF16 (bf16_gemm.h): S = Q K^T from the
// inputs' bf16 rows (exact products, K packed as pair words) and acc += P V with P rounded to
// bf16, or as two bf16 parts where a backward follows (see Bf16Gemms), all on the bf16
// instructions; the softmax and acc stay fp32.
#include <optional>
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/attention_scores.h"
#include "cpu/attention_sequences.h"
#include "cpu/attention_mask_structure.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

using namespace attn;

// The GEMMs of a query block, fp32 micro-kernel (every dtype; bf16 without bf16 GEMMs): Q staged in
// MR-row panels (the S GEMM streams them sequentially), S = Q K^T against packed K^T panels,
// acc (+)= P V against packed V column panels.
template <typename T>
struct Fp32Gemms {
  using A = acc_t<T>;
  static constexpr int64_t MR = MicroShape<A>::kMR, NR = MicroShape<A>::kNR;
  const Shape<A>& sh;
  A* const q_rows;    // one panel's rows, staged
  A* const q_packed;  // MR-row panels

  Fp32Gemms(const Shape<A>& shape, Bf16Gemm, bool)
      : sh(shape),
        q_rows(thread_scratch<A, Scratch::kFwdQStage>(MR * shape.D_pad)),
        q_packed(thread_scratch<A, Scratch::kFwdQPanels>(kQBlockRows<A> * shape.D)) {}

  void load_q(const AttnArgs& a, int64_t b, int64_t h, int64_t q0, int64_t n_q) {
    for (int64_t p0 = 0; p0 < n_q; p0 += MR) {
      for (int64_t r = 0; r < MR; ++r) {
        A* q_row = q_rows + r * sh.D_pad;
        if (p0 + r < n_q) {
          load_row(row_ptr<T>(a.q, b, h, q0 + p0 + r), sh.D, sh.D_pad, q_row);
        } else {
          std::fill(q_row, q_row + sh.D_pad, A(0));
        }
      }
      put_mr_panel(q_rows, sh.D_pad, sh.D, q_packed + p0 * sh.D);
    }
  }
  void scores(const Packed<A>& pk, int64_t bh_kv, int64_t kb, int64_t n_q, int64_t cols, A* s_tile, Band band) const {
    tile_gemm<A, 1, MR>(n_q, cols, sh.D, q_packed, 1, MR, pk.kt_block(bh_kv, kb), NR, sh.D * NR, s_tile, kScoreLd,
                        false, band, sh.D * MR);
  }
  void p_row(const A*, int64_t, int64_t) {}  // P is read from the score tile itself
  // Over the block's keys (the padding columns' P is 0).
  void pv(const Packed<A>& pk, int64_t bh_kv, int64_t kb, int64_t n_q, int64_t n_keys, int64_t, const A* s_tile,
          A* acc, bool accumulate, Band band) const {
    tile_gemm<A, kScoreLd, 1>(n_q, sh.Dv, n_keys, s_tile, kScoreLd, 1, pk.vp_block(bh_kv, kb), NR, sh.Bk_pad * NR, acc,
                              sh.Dv_pad, accumulate, band);
  }
};

// The GEMMs of a query block on bf16 instructions (bf16 inputs, bf16_gemm.h): S = Q K^T from the block's
// bf16 rows (exact products), acc (+)= P V with P rounded to bf16 (torch's CPU flash attention and
// FlashAttention round so; the row sums are those of the fp32 P), or, in calls that write the
// output's rounding residual (a backward follows), acc (+)= P_hi V + P_lo V with P's rows split
// into two bf16 parts (split_row_to_bf16: P to ~16 bits). With P rounded alone, the fp32 output
// is off the backward's sum_j P_ij V_j by P's rounding, as much as by the output's own, and the
// backward's delta from out + out_residual came only 2.2x closer than delta from the rounded
// output (rows of dS summing to 0, tests/test_attention_delta.py, 2-core Zen 4); split, 486-780x
// (the fp32 path's 490-830x). The second GEMM costs ~30% of a bf16 forward at head dim 128
// there ((1, 16, 1024, 128): 26-32 -> 37-40 ms) and 7-15% of a forward+backward, so calls
// without a gradient do not split.
template <typename T>
struct Bf16Gemms {
  using A = acc_t<T>;
  const Shape<A>& sh;
  const Bf16Gemm kind;
  c10::BFloat16* const q_bf16;  // the block's bf16 rows, zero rows up to a multiple of 16
  c10::BFloat16* const p_hi;    // P (split: p_hi + p_lo), rows of kBlockK, zero rows up to a multiple of 16
  c10::BFloat16* const p_lo;
  const bool split;
  static_assert(kBlockQ % 16 == 0, "16-row tiles of P and acc stay within the block's rows");

  Bf16Gemms(const Shape<A>& shape, Bf16Gemm gemm_kind, bool split_p)
      : sh(shape),
        kind(gemm_kind),
        q_bf16(thread_scratch<c10::BFloat16, Scratch::kFwdQBf16>((kBlockQ + 16) * shape.D_bf16)),
        p_hi(thread_scratch<c10::BFloat16, Scratch::kFwdPHi>(kBlockQ * kBlockK)),
        p_lo(split_p ? thread_scratch<c10::BFloat16, Scratch::kFwdPLo>(kBlockQ * kBlockK) : nullptr),
        split(split_p) {
    TORCH_INTERNAL_ASSERT(sh.Dv_bf16 == sh.Dv_pad, "bf16 P V tiles write acc rows Dv_pad wide");
  }

  void load_q(const AttnArgs& a, int64_t b, int64_t h, int64_t q0, int64_t n_q) {
    stage_bf16_rows(a.q, b, h, q0, 0, n_q, round_up_to(n_q, 16), sh.D, sh.D_bf16, q_bf16);
    for (c10::BFloat16* p : {p_hi, p_lo})
      if (p) std::fill(p + n_q * kBlockK, p + round_up_to(n_q, 16) * kBlockK, c10::BFloat16(0.0f));
  }
  void scores(const Packed<A>& pk, int64_t bh_kv, int64_t kb, int64_t n_q, int64_t cols, A* s_tile, Band band) const {
    tile_gemm_bf16(kind, n_q, cols, sh.D_bf16, q_bf16, sh.D_bf16, pk.kw_block(bh_kv, kb), s_tile, kScoreLd, false, band);
  }
  void p_row(const A* p, int64_t i, int64_t cols) {
    if (split) split_row_to_bf16(p, cols, p_hi + i * kBlockK, p_lo + i * kBlockK);
    else round_row_to_bf16(p, cols, p_hi + i * kBlockK);
  }
  // Over the block's score columns (whole pair words; the padding columns' P is 0).
  void pv(const Packed<A>& pk, int64_t bh_kv, int64_t kb, int64_t n_q, int64_t, int64_t cols, const A*, A* acc,
          bool accumulate, Band band) const {
    const uint32_t* v_pairs = pk.vpw_block(bh_kv, kb);
    tile_gemm_bf16(kind, n_q, sh.Dv_bf16, cols, p_hi, kBlockK, v_pairs, acc, sh.Dv_pad, accumulate, band);
    if (split) tile_gemm_bf16(kind, n_q, sh.Dv_bf16, cols, p_lo, kBlockK, v_pairs, acc, sh.Dv_pad, true, band);
  }
};

// What every query block of a call shares.
template <typename T>
struct FwdCall {
  using A = acc_t<T>;
  const AttnArgs& a;
  Shape<A> sh;                      // (points at terms_table)
  const TermsTable<A> terms_table;  // ALiBi and the relative bias over j - i
  const uint32_t threshold;   // dropout: drop a probability iff its Philox word is below
  const A out_scale;          // 1 / (1 - p)
  const A score_mul;          // S = Q K^T to log2 units, see exp2_row
  A* const lse;
  const MaskTiles mask_tiles;  // tiles a bool mask / the key padding masks or attends wholly

  explicit FwdCall(const AttnArgs& args)
      : a(args), sh(args), terms_table(args, sh), threshold(args.dropout_p > 0 ? dropout_threshold(args.dropout_p) : 0),
        out_scale(args.dropout_p > 0 ? A(1) / static_cast<A>(1.0 - args.dropout_p) : A(1)),
        score_mul(static_cast<A>(args.scale * kLog2e)), lse(static_cast<A*>(args.lse)),
        mask_tiles(args, kBlockQ, kBlockK) {}
};

// Tiles no edge, mask or padding column touches, with a softcap or inline terms (ALiBi, the
// relative bias): the scores are computed from S in the row's passes, without score_row's
// general bias / mask loop. x_j is score_row's (and the backward's p_ds_row's) to the bit, so P
// is too. A softcap alone needs no max pass of its own: cap_out * tanh(cap_in * S) grows with S
// (cap_in > 0), so the row max is the capped max of S, and the exp pass computes the capped
// scores where it uses them. A softcapped bf16 (1, 8, 2048, 64) forward on a 2-core Zen 5 took
// 1.30x the time of the call without softcap through score_row, 1.08-1.15x on the fly
// (fastformer-bench --op attention --match softcap, each side by side with the plain call).
// With terms the max pass computes every score anyway (S scaled plus the TermsTable's entry):
// it writes them over S (the row is in L1), and the exp pass is the plain one.
// A new option that changes the scores must be computed in at() or make this false.
template <typename A>
bool scores_on_the_fly(const Shape<A>& sh, int64_t q0, int64_t q1, int64_t kb, bool mask_free) {
  const int64_t n_keys = sh.block_keys(kb);
  return !sh.cut(q0, q1, kb) && n_keys == sh.block_cols(n_keys) && (!sh.bias_row || mask_free) &&
         (sh.alibi || sh.rel || sh.cap_out != A(0));
}

template <typename A, bool kCapped, bool kTerms>
struct OnTheFlyScores {
  using V = Vectorized<A>;
  const Shape<A>& sh;
  const A* const terms;  // the row's slice of the call's TermsTable
  const V mul;

  OnTheFlyScores(const Shape<A>& shape, A score_mul, int64_t b, int64_t h, int64_t qi, int64_t k0)
      : sh(shape),
        terms(kTerms ? sh.terms + b * sh.terms_bs + h * sh.terms_ld + (k0 - qi + sh.Lq - 1) : nullptr),
        mul(score_mul) {}

  // transform_scores with the options known at compile time (InlineBias::at reads the table).
  V at(const A* s, int64_t j) const {
    const V extra = kTerms ? V::loadu(terms + j) : V(A(0));
    if constexpr (kCapped) return sh.cap(V::loadu(s + j), extra);
    return at::vec::fmadd(V::loadu(s + j), mul, extra);
  }
  // Whether max() computes every score and leaves them in s for exp2(): with terms, a cap
  // whose max is not the capped max of S (cap_in <= 0, from a scale <= 0), or rows whose P the
  // backward computes from the rounded capped score (Shape::cap_fused: a bias row, dropout).
  bool stored() const { return kTerms || !sh.cap_fused(false, 0, 0); }
  // The row's block max; *small (capped, not stored): whether every |cap_in S| is below the
  // folded polynomial's bound (ScaledTanh), so that exp2() skips the per-vector test.
  A max(A* s, int64_t cols, bool* small) const {
    if (!stored()) {
      V hi(kNegInf<A>), lo(std::numeric_limits<A>::infinity());
      for (int64_t j = 0; j < cols; j += V::size()) {
        const V S = V::loadu(s + j);
        hi = max_nan_from_first(hi, S);
        lo = min_nan_from_first(lo, S);
      }
      const A s_hi = reduce_max_no_nan(hi);
      const A bound = reduce_max_no_nan(max_nan_from_first(hi, V(A(0)) - lo));  // max |S|
      *small = sh.cap.folded && bound * bound < sh.cap.small_x2;
      return sh.cap.scalar(s_hi);
    }
    V m(kNegInf<A>);
    for (int64_t j = 0; j < cols; j += V::size()) {
      const V x = at(s, j);
      x.store(s + j);
      m = max_nan_from_first(m, x);
    }
    return reduce_max_no_nan(m);
  }
  // As exp2_row after score_row (mul = 1), but with the capped scores computed here (not
  // stored), where P = 2^(cap(S) - shift) is one rounding of the sum (the backward's p_ds_row
  // computes uncut rows so too).
  A exp2(A* s, int64_t cols, A shift, bool small, bool max_skipped) const {
    const V neg_shift(-shift);
    V sum(A(0));
    if constexpr (kTerms && !kCapped) {
      if (max_skipped) {  // the scores as max() stores them, then exp2_row's shift
        for (int64_t j = 0; j < cols; j += V::size()) {
          const V p = exp2_nonpositive(at::vec::fmadd(at(s, j), V(A(1)), neg_shift));
          p.store(s + j);
          sum = sum + p;
        }
        return reduce_add(sum);
      }
    }
    if (stored()) return exp2_row(s, cols, shift);
    const ScaledTanh<A> cap = sh.cap;  // (a local copy: in registers, see p_ds_row)
    const auto loop = [&](auto long_poly, auto all_small) {
      for (int64_t j = 0; j < cols; j += V::size()) {
        const V S = V::loadu(s + j);
        V x;
        if constexpr (decltype(all_small)::value) {  // no per-vector range test
          x = at::vec::fmadd(S, cap.template poly<long_poly>(S * S), neg_shift);
        } else {
          x = cap.template apply<long_poly>(S, neg_shift);
        }
        const V p = exp2_nonpositive(x);
        p.store(s + j);
        sum = sum + p;
      }
    };
    cap.with_degree([&](auto long_poly) {
      if (small) loop(long_poly, std::true_type{});
      else loop(long_poly, std::false_type{});
    });
    return reduce_add(sum);
  }
};

// f(OnTheFlyScores<A, capped, terms>) for the row's options.
template <typename A, class F>
auto with_scores_on_the_fly(const Shape<A>& sh, A mul, int64_t b, int64_t h, int64_t qi, int64_t k0, const F& f) {
  const bool capped = sh.cap_out != A(0), terms = sh.alibi || sh.rel;
  if (capped && terms) return f(OnTheFlyScores<A, true, true>(sh, mul, b, h, qi, k0));
  if (capped) return f(OnTheFlyScores<A, true, false>(sh, mul, b, h, qi, k0));
  return f(OnTheFlyScores<A, false, true>(sh, mul, b, h, qi, k0));
}

// Query block qb of head (b, h), K/V from packed head bh_kv of pk (read-only): the online
// softmax over the key blocks the queries can see, shared by both GEMM paths.
template <typename T, class Gemms>
void query_block(const FwdCall<T>& c, Gemms& gemms, const Packed<acc_t<T>>& pk, int64_t bh_kv, int64_t b,
                 int64_t h, int64_t qb) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const AttnArgs& a = c.a;
  const Shape<A>& sh = c.sh;
  const int64_t q0 = qb * kBlockQ, n_q = std::min(kBlockQ, sh.Lq - q0);
  A* const s_tile = thread_scratch<A, Scratch::kFwdScores>((kBlockQ + kRowSlack) * kScoreLd);
  A* const acc = thread_scratch<A, Scratch::kFwdAcc>(kBlockQ * sh.Dv_pad);
  A* const bias = thread_scratch<A, Scratch::kFwdBias>(sh.Bk_pad + Vectorized<A>::size());
  A* const row_max = thread_scratch<A, Scratch::kFwdRowMax>(kBlockQ);
  A* const row_sum = thread_scratch<A, Scratch::kFwdRowSum>(kBlockQ);
  A* const q_norm2 = thread_scratch<A, Scratch::kFwdQNorm>(kBlockQ);

  gemms.load_q(a, b, h, q0, n_q);
  for (int64_t i = 0; i < n_q; ++i) q_norm2[i] = squared_norm(row_ptr<T>(a.q, b, h, q0 + i), sh.D);
  std::fill(row_max, row_max + kBlockQ, kNegInf<A>);
  std::fill(row_sum, row_sum + kBlockQ, A(0));

  // The key blocks the block's queries can see (the band's edges: causality, the window).
  const int64_t kb_begin = sh.kb_begin(q0), kb_end = sh.kb_end(q0 + n_q), n_visible = kb_end - kb_begin;
  // With ALiBi the visit starts at the key block of the block's middle query's diagonal and
  // wraps around: a row's largest scores sit near its diagonal, so its max seldom moves after
  // the first block. In key order it moved at every block up to the diagonal, and each move
  // costs a scalar exp2 and a pass over the row's accumulator: a bf16 ALiBi forward at (1, 8,
  // 2048, 64) on the 2-core AMX Xeon took 1.24x the plain call's time in key order, 1.00-1.01x
  // in this one (the backward's P comes from the saved lse: any order gives it).
  const int64_t kb_first =
      sh.alibi && n_visible > 0 ? std::clamp((q0 + n_q / 2 + sh.diag) / kBlockK, kb_begin, kb_end - 1) : kb_begin;
  // acc: written by the first visited key block's P V (accumulate = false), zero if none is.
  bool acc_written = false;
  for (int64_t visit = 0; visit < n_visible; ++visit) {
    const int64_t kb = kb_begin + (kb_first - kb_begin + visit) % n_visible;
    const MaskTiles::State mask_state = c.mask_tiles.at(b, h, q0, kb);
    if (mask_state == MaskTiles::kDead) continue;
    const int64_t k0 = kb * kBlockK, n_keys = sh.block_keys(kb), cols = sh.block_cols(n_keys);
    // Diagonal tiles: micro-tiles wholly above the diagonal are skipped in both GEMMs.
    gemms.scores(pk, bh_kv, kb, n_q, cols, s_tile, sh.band(q0, q0 + n_q, kb, Band::kColsUpTo));
    const bool cut = sh.cut(q0, q0 + n_q, kb);
    // P as the backward computes it (Shape::unmasked): straight from S with one FMA per
    // score, or after score_row's transform and bias. (A scale <= 0, allowed, flips which
    // score is the max: score_row handles it.)
    const bool unmasked = sh.unmasked(q0, q0 + n_q, kb, c.score_mul, mask_state == MaskTiles::kFull);
    const bool on_the_fly = !unmasked && scores_on_the_fly(sh, q0, q0 + n_q, kb, mask_state == MaskTiles::kFull);
    const bool shared_bias = sh.shared_bias(a, q0, q0 + n_q, kb);
    const bool cap_alone = sh.cap_fused(false, 0, 0);  // on the fly: OnTheFlyScores::stored() is false
    const bool terms_alone = (sh.alibi || sh.rel) && sh.cap_out == A(0) && c.score_mul > A(0);
    for (int64_t i = 0; i < n_q; ++i) {
      A* s = s_tile + i * kScoreLd;
      const auto fly = [&](const auto& f) { return with_scores_on_the_fly(sh, c.score_mul, b, h, q0 + i, k0, f); };
      bool small = false;  // (on the fly, capped: the row's scores are in the folded polynomial's range)
      // An unmasked tile whose scores cannot exceed the row's running max by more than
      // kShiftHeadroom (Cauchy-Schwarz: scale S_ij <= scale |q_i| max_j |k_j|) keeps that max
      // as its shift: no max pass (P up to 2^kShiftHeadroom, the row's sum and lse exact all
      // the same; the first visited block, and blocks whose bound is loose, take the pass).
      // A softcap alone (on the fly, not stored) bounds c tanh(k S) the same way, and |S|'s
      // bound may put the whole tile in the folded polynomial's range (ScaledTanh).
      // So do terms alone (ALiBi, the relative bias: at most the TermsTable's largest entry);
      // exp2() then computes the scores max() would have stored.
      bool bounded = false;
      if ((unmasked || (on_the_fly && (cap_alone || terms_alone))) && row_max[i] > kNegInf<A>) {
        const A qk = q_norm2[i] * pk.key_norm2(bh_kv, kb), s_bound = std::sqrt(qk);
        const A bound = unmasked      ? s_bound * c.score_mul
                        : terms_alone ? s_bound * c.score_mul + sh.terms_bound(b, h)
                                      : sh.cap.scalar(s_bound);
        bounded = bound <= row_max[i] + kShiftHeadroom;
        if (bounded && !unmasked) small = sh.cap.folded && qk < sh.cap.small_x2;
      }
      const A block_max = bounded      ? row_max[i]
                          : unmasked   ? row_max_of(s, cols) * c.score_mul  // log2 units
                          : on_the_fly ? fly([&](const auto& scores) { return scores.max(s, cols, &small); })
                                       : score_row(a, sh, s, c.score_mul, b, h, q0 + i, k0, n_keys, cols, cut, bias,
                                                   static_cast<A*>(nullptr), shared_bias && i > 0);
      const A new_max = std::max(row_max[i], block_max);
      // alpha = 1 exactly when the max did not move (most key blocks): no exp call.
      const A alpha = new_max == row_max[i] ? A(1) : online_softmax_alpha_log2(row_max[i], new_max);
      const A shift = softmax_shift(new_max);
      // A cut tile's rows exp only their band's vectors (exp2_row_band): a window (left 512)
      // forward at (1, 8, 8192, 64), 2-core AMX Xeon, alternating builds: bf16 19.2-19.6 ms ->
      // 17.8-18.9, fp32 41.3-42.2 -> 39.2-40.1.
      const A block_sum =
          on_the_fly ? fly([&](const auto& scores) { return scores.exp2(s, cols, shift, small, bounded); })
          : cut      ? exp2_row_band(s, cols, sh.lo_begin(q0 + i, k0, n_keys), sh.hi_end(q0 + i, k0, n_keys), shift)
                     : exp2_row(s, cols, shift, unmasked ? c.score_mul : A(1));
      row_sum[i] = alpha * row_sum[i] + block_sum;
      row_max[i] = new_max;
      if (c.threshold) drop_row(a, s, b, h, q0 + i, k0, n_keys, c.threshold);
      if (alpha != A(1) && acc_written) {  // (before the first block's P V, acc holds nothing)
        A* acc_i = acc + i * sh.Dv_pad;
        const V alpha_v(alpha);
        for (int64_t d = 0; d < sh.Dv_pad; d += V::size()) (V::loadu(acc_i + d) * alpha_v).store(acc_i + d);
      }
      gemms.p_row(s, i, cols);
    }
    gemms.pv(pk, bh_kv, kb, n_q, n_keys, cols, s_tile, acc, acc_written, sh.band(q0, q0 + n_q, kb, Band::kInnerUpTo));
    acc_written = true;
  }
  if (!acc_written) std::fill(acc, acc + kBlockQ * sh.Dv_pad, A(0));

  // A sink joins the denominator (adding no value): the row's max and sum take it, and the
  // accumulator is rescaled when it moves the max.
  const A sink = a.sinks ? static_cast<const A*>(a.sinks)[h] * static_cast<A>(kLog2e) : A(0);
  for (int64_t i = 0; i < n_q; ++i) {
    const A rescale = a.sinks ? softmax_join_sink_log2(row_max[i], row_sum[i], sink) : A(1);
    const V inv(softmax_inv_sum(row_sum[i]) * c.out_scale * rescale);
    store_out_row<T>(a, b, h, q0 + i, acc + i * sh.Dv_pad, inv);
    c.lse[b * a.lse_s[0] + h * a.lse_s[1] + q0 + i] = softmax_lse_log2(row_max[i], row_sum[i]);
  }
}

// The call's tasks: whole heads packing their own K/V (when the blocks a query block sees fit
// in L2 with room to spare and there are enough heads to keep every thread busy: written and
// read back from cache), or query blocks sharing K/V packed up front for every head (written
// to memory and read back by each task of the head).
template <typename T, class Gemms>
void run_tasks(const FwdCall<T>& c, Bf16Gemm kind) {
  using A = acc_t<T>;
  const Shape<A>& sh = c.sh;
  const bool pairs = kind != Bf16Gemm::kFp32;
  const int64_t k_packed_bytes = pairs ? sh.D_bf16 * 2 : sh.D * static_cast<int64_t>(sizeof(A));  // per key
  const int64_t v_packed_bytes = pairs ? sh.Dv_bf16 * 2 : sh.Dv_pad * static_cast<int64_t>(sizeof(A));
  const int64_t block_packed_bytes = sh.Bk_pad * (k_packed_bytes + v_packed_bytes);
  // The most key blocks one query block sees: a window's band, else the head's.
  int64_t band_blocks = 0;
  for (int64_t qb = 0; qb < sh.n_qb; ++qb)
    band_blocks = std::max(band_blocks, sh.kb_end(std::min(sh.Lq, (qb + 1) * kBlockQ)) - sh.kb_begin(qb * kBlockQ));
  const bool pack_in_task = std::min(sh.n_kb, band_blocks + 1) * block_packed_bytes <= kPackInTaskBytes &&
                            sh.B * sh.H >= kHeadTasksPerThread * at::get_num_threads();
  std::optional<Packed<A>> shared;
  if (!pack_in_task) {
    shared.emplace(sh, sh.B * sh.Hkv, sh.n_kb, /*backward=*/false, pairs);
    pack_kv<T, A>(c.a, sh, *shared);
  }
  const double flops = 2.0 * sh.B * sh.H * sh.Lq * sh.Lk * (sh.D + sh.Dv);
  const int64_t n_tasks = pack_in_task ? sh.B * sh.H : sh.B * sh.H * sh.n_qb;
  parallel_tasks(n_tasks, flops, [&](int64_t task) {
    const AmxTiles tiles(kind);
    Gemms gemms(sh, kind, /*split_p=*/c.a.out_residual.ptr != nullptr);
    const int64_t bh = pack_in_task ? task : task / sh.n_qb;
    const int64_t b = bh / sh.H, h = bh % sh.H, hkv = h / sh.G;
    if (!pack_in_task) {
      query_block(c, gemms, *shared, b * sh.Hkv + hkv, b, h, task % sh.n_qb);
      return;
    }
    // Each key block packed when the first query block that sees it runs: the blocks a query
    // block reads were packed by it or by the one or two before it (still in cache). A window
    // (left 512) at (1, 8, 8192, 64) packs 5 blocks per query block this way instead of 2 MB
    // per head up front (fp32 forward 44.0-44.2 -> 41.3-42.8 ms, bf16 within noise).
    Packed<A> own(sh, 1, sh.n_kb, /*backward=*/false, pairs);
    int64_t packed_end = 0;
    for (int64_t qb = 0; qb < sh.n_qb; ++qb) {
      const int64_t q0 = qb * kBlockQ, kb_end = sh.kb_end(std::min(sh.Lq, q0 + kBlockQ));
      for (int64_t kb = std::max(packed_end, sh.kb_begin(q0)); kb < kb_end; ++kb)
        pack_kv_block<T, A>(c.a, sh, own, b, hkv, kb, 0, kb);
      packed_end = std::max(packed_end, kb_end);
      query_block(c, gemms, own, 0, b, h, qb);
    }
  });
}

template <typename T>
void attention_fwd_typed(const AttnArgs& a) {
  if (decodes(a)) return attention_decode(a);
  if (a.cu_q || a.k_lens) {  // one call per sequence; rows without keys: out 0, lse +inf
    std::vector<T> pages;
    for (const AttnArgs& s : split_sequences(a)) {
      if (s.Lq > 0 && s.Lk > 0 && s.block_table && !decodes(s)) {
        attention_fwd_typed<T>(gather_pages<T>(s, pages));
      } else if (s.Lq > 0 && s.Lk == 0) {
        zero_rows<T>(s.out, s.H, s.Lq, s.Dv);
        for (int64_t h = 0; h < s.H; ++h)
          std::fill_n(static_cast<acc_t<T>*>(s.lse) + h * s.lse_s[1], s.Lq, std::numeric_limits<acc_t<T>>::infinity());
      } else if (s.Lq > 0) {
        attention_fwd_typed<T>(s);
      }
    }
    return;
  }
  if (AttnArgs band = a; fold_band_mask(band)) return attention_fwd_typed<T>(band);
  const FwdCall<T> c(a);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const Bf16Gemm kind = bf16_gemm();
    if (kind != Bf16Gemm::kFp32) return run_tasks<T, Bf16Gemms<T>>(c, kind);
  }
  run_tasks<T, Fp32Gemms<T>>(c, Bf16Gemm::kFp32);
}

}  // namespace

void attention_fwd(const AttnArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { attention_fwd_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
