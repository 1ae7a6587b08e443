// Attention forward for calls with few queries per batch row: decoding against a KV cache
// (flash-decoding). Semantics: fastformer/reference/attention.py and reference/varlen.py.
//
// The flash forward (attention_fwd.cpp) packs K and V per query head and runs query blocks of
// 144 rows; with one query per head that packs each kv head G times (GQA) and computes one row
// per tile. Here a task is (batch row b, kv head, key split): it packs each of its key blocks
// once (K^T and V panels, attention_common.h, in its thread's cache) and runs every query of the
// kv head's G query heads against it as the rows of one tile, R = G * Lq rows:
//   S = Q_rows K^T_block                      micro-kernel GEMM, R x block
//   row by row: score_row (band, masks, biases, softcap), the online softmax (common/
//   online_softmax.h, log2 units)
//   acc = alpha * acc + P V_block             micro-kernel GEMM
// and writes its rows' (max, sum, acc) for its split. The keys of a call are split into
// pieces of kBlocksPerSplit key blocks (a cache of 4096 keys: 6 tasks per kv head, so batch 1
// with few kv heads still uses every core; the split depends on the keys only, not on the
// thread count, and costs (splits * Dv) partials per row beside 2 * Lk * D keys read); the
// splits of a row are merged in split order by their log-sum-exp (out = sum_s acc_s 2^(m_s - M)
// / sum_s l_s 2^(m_s - M), M = max_s m_s; a sink joins the merged denominator), a deterministic
// result for any thread count. With one split the task writes the output itself.
// Memory: K and V of a kv head read once per call (memory-bound: 2 * Lk * D per kv head),
// Q, out and the partials O(B * H * Lq * (D + splits * Dv)).
// Variable key lengths (k_lens, a KV cache) and paged caches (block_table) are read directly.
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/attention_scores.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

using namespace attn;

constexpr int64_t kBlocksPerSplit = 4;  // 768 keys

template <typename T>
void attention_decode_typed(const AttnArgs& a) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t MR = MicroShape<A>::kMR, NR = MicroShape<A>::kNR;
  const Shape<A> full(a);
  const int64_t G = full.G, Lq = a.Lq, R = G * Lq;  // a task's rows: (g, i) at g * Lq + i
  const int64_t n_split = std::max<int64_t>((full.n_kb + kBlocksPerSplit - 1) / kBlocksPerSplit, 1);
  // Partials of the splits (one split: the task writes out and lse itself).
  const int64_t n_rows = a.B * a.H * Lq, Dv_pad = full.Dv_pad;
  A* const part_m = n_split > 1 ? thread_scratch<A, Scratch::kDecRowMaxParts>(n_rows * n_split) : nullptr;
  A* const part_l = n_split > 1 ? thread_scratch<A, Scratch::kDecRowSumParts>(n_rows * n_split) : nullptr;
  A* const part_acc = n_split > 1 ? thread_scratch<A, Scratch::kDecAccParts>(n_rows * n_split * Dv_pad) : nullptr;
  const A score_mul = static_cast<A>(a.scale * kLog2e);

  // Row (b, h, i) of the output and its lse from a finished (max, sum, acc).
  auto finish_row = [&](int64_t b, int64_t h, int64_t i, A m, A l, const A* acc) {
    A rescale = A(1);
    if (a.sinks) rescale = softmax_join_sink_log2(m, l, static_cast<const A*>(a.sinks)[h] * static_cast<A>(kLog2e));
    const V inv(softmax_inv_sum(l) * rescale);
    T* out_i = const_cast<T*>(row_ptr<T>(a.out, b, h, i));
    int64_t d = 0;
    for (; d + V::size() <= a.Dv; d += V::size()) store_acc(out_i + d, V::loadu(acc + d) * inv);
    if (d < a.Dv) store_acc(out_i + d, V::loadu(acc + d) * inv, a.Dv - d);
    static_cast<A*>(a.lse)[b * a.lse_s[0] + h * a.lse_s[1] + i] = softmax_lse_log2(m, l);
  };

  const double flops = 2.0 * a.B * a.H * Lq * a.Lk * (a.D + a.Dv);
  parallel_tasks(a.B * a.Hkv * n_split, flops, [&](int64_t task) {
    const int64_t split = task % n_split, bhkv = task / n_split;
    const int64_t b = bhkv / a.Hkv, hkv = bhkv % a.Hkv;
    AttnArgs ab = a;  // this row's key length (a KV cache: the band's d follows it)
    if (a.k_lens) ab.Lk = a.k_lens[b];
    const Shape<A> sh(ab);
    const int64_t kb_lo = sh.kb_begin(0), kb_hi = sh.kb_end(Lq);
    const int64_t per_split = (std::max<int64_t>(kb_hi - kb_lo, 0) + n_split - 1) / n_split;
    const int64_t kb0 = kb_lo + split * per_split, kb1 = std::min(kb_hi, kb0 + per_split);

    A* const q_rows = thread_scratch<A, Scratch::kDecQStage>(MR * sh.D_pad);
    A* const q_packed = thread_scratch<A, Scratch::kDecQPanels>(round_up_to(R, MR) * sh.D);
    A* const s_tile = thread_scratch<A, Scratch::kDecScores>((round_up_to(R, MR) + kRowSlack) * kScoreLd);
    A* const acc = thread_scratch<A, Scratch::kDecAcc>(R * Dv_pad);
    A* const bias = thread_scratch<A, Scratch::kDecBias>(sh.Bk_pad + V::size());
    A* const row_max = thread_scratch<A, Scratch::kDecRowMax>(R);
    A* const row_sum = thread_scratch<A, Scratch::kDecRowSum>(R);
    // Q of the G heads' rows, in MR-row panels.
    for (int64_t p0 = 0; p0 < R; p0 += MR) {
      for (int64_t r = 0; r < MR; ++r) {
        A* q_row = q_rows + r * sh.D_pad;
        const int64_t row = p0 + r;
        if (row < R) load_row(row_ptr<T>(a.q, b, hkv * G + row / Lq, row % Lq), sh.D, sh.D_pad, q_row);
        else std::fill(q_row, q_row + sh.D_pad, A(0));
      }
      put_mr_panel(q_rows, sh.D_pad, sh.D, q_packed + p0 * sh.D);
    }
    std::fill(row_max, row_max + R, kNegInf<A>);
    std::fill(row_sum, row_sum + R, A(0));
    if (kb0 >= kb1) std::fill(acc, acc + R * Dv_pad, A(0));
    Packed<A> pk(sh, 1, 1, /*backward=*/false, /*pairs=*/false);
    pk.k_norm2 = nullptr;  // (no score bounds here: every block's rows take the max pass)
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t k0 = kb * kBlockK, n_keys = sh.block_keys(kb), cols = sh.block_cols(n_keys);
      pack_kv_block<T, A>(ab, sh, pk, b, hkv, kb, 0, 0);
      const Packed<A>& packed = pk;
      tile_gemm<A, 1, MR>(R, cols, sh.D, q_packed, 1, MR, packed.kt_block(0, 0), NR, sh.D * NR, s_tile, kScoreLd,
                          false, Band{}, sh.D * MR);
      // As the backward will decide for this tile (its queries 0 .. Lq are one query block there),
      // so that it recomputes P by the same formula.
      const bool cut = sh.cut(0, Lq, kb);
      const bool unmasked = sh.unmasked(0, Lq, kb, score_mul, false);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hkv * G + r / Lq, qi = r % Lq;
        A* s = s_tile + r * kScoreLd;
        const A block_max = unmasked ? row_max_of(s, cols) * score_mul
                                     : score_row(ab, sh, s, score_mul, b, h, qi, k0, n_keys, cols, cut, bias);
        const A new_max = std::max(row_max[r], block_max);
        const A alpha = new_max == row_max[r] ? A(1) : online_softmax_alpha_log2(row_max[r], new_max);
        row_sum[r] = alpha * row_sum[r] + exp2_row(s, cols, softmax_shift(new_max), unmasked ? score_mul : A(1));
        row_max[r] = new_max;
        if (alpha != A(1) && kb > kb0) {
          A* acc_r = acc + r * Dv_pad;
          const V alpha_v(alpha);
          for (int64_t d = 0; d < Dv_pad; d += V::size()) (V::loadu(acc_r + d) * alpha_v).store(acc_r + d);
        }
      }
      tile_gemm<A, kScoreLd, 1>(R, sh.Dv, n_keys, s_tile, kScoreLd, 1, packed.vp_block(0, 0), NR, sh.Bk_pad * NR,
                                acc, Dv_pad, kb > kb0, Band{});
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t h = hkv * G + r / Lq, qi = r % Lq;
      if (n_split == 1) {
        finish_row(b, h, qi, row_max[r], row_sum[r], acc + r * Dv_pad);
        continue;
      }
      const int64_t at = ((b * a.H + h) * Lq + qi) * n_split + split;
      part_m[at] = row_max[r];
      part_l[at] = row_sum[r];
      std::copy(acc + r * Dv_pad, acc + (r + 1) * Dv_pad, part_acc + at * Dv_pad);
    }
  });
  if (n_split == 1) return;

  // Merge the splits of each row, in split order.
  at::parallel_for(0, n_rows, 16, [&](int64_t r0, int64_t r1) {
    A* const merged = thread_scratch<A, Scratch::kDecMerged>(Dv_pad);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r % Lq, bh = r / Lq, b = bh / a.H, h = bh % a.H;
      A m = kNegInf<A>;
      for (int64_t s = 0; s < n_split; ++s) m = std::max(m, part_m[r * n_split + s]);
      A l = 0;
      std::fill(merged, merged + Dv_pad, A(0));
      for (int64_t s = 0; s < n_split; ++s) {
        const A w = online_softmax_alpha_log2(part_m[r * n_split + s], m);  // 0 for an empty split
        l += w * part_l[r * n_split + s];
        const V w_v(w);
        const A* acc_s = part_acc + (r * n_split + s) * Dv_pad;
        for (int64_t d = 0; d < Dv_pad; d += V::size())
          at::vec::fmadd(V::loadu(acc_s + d), w_v, V::loadu(merged + d)).store(merged + d);
      }
      finish_row(b, h, i, m, l, merged);
    }
  });
}

}  // namespace

void attn::attention_decode(const AttnArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { attention_decode_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
