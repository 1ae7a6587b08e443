// Flash attention backward on CPU (semantics and formulas: fastformer/reference/attention.py).
//
// Recomputes the probabilities tile by tile from the saved lse; no Lq x Lk buffer:
//   delta_i = sum_d dO_id O_id                    (per head, while its dO rows are packed)
//   per (query block, key block) tile:
//     S   = Q K^T                     P = exp(scale * S + mask - lse)   (0 where masked)
//     dP  = dO V^T                    with dropout: P' = P keep/(1-p), dP' = dP keep/(1-p)
//     dV += P'^T dO                   dS = P (dP' - delta)
//     dK += dS^T Q                    dQ += dS K              (scale applied once at the end)
// Five micro-kernel GEMMs per tile (2.5x the forward's flops), P^T and dS^T read as transposed
// views (no transposition copies). Causal: tiles above the diagonal are never visited, and in
// tiles the diagonal cuts every GEMM skips the micro-tiles / inner ranges wholly above it.
// Tiles a bool mask or the key padding excludes wholly are not visited either (their P and dS
// are 0; attention_mask_structure.h).
//
// Parallelism: tasks are (batch, kv head, key chunk). A task owns dK and dV of its keys for all
// the query heads of its kv head (GQA sums need no atomics) and walks every query block that
// can see them (causal: those at or below the diagonal). dQ of a head gets contributions from
// every key chunk: with one chunk (B * Hkv >= kMinTasks) the task accumulates it in its own
// fp32 buffer and writes it when the head is done; with several, each chunk writes its own fp32
// dQ partial, summed in chunk order at the end. The chunk count depends on the shape only (not
// on the thread count): results are bitwise identical for any number of threads.
// Memory, per task (the thread's scratch): its key blocks packed as K^T, V^T and K (fp32,
// Packed, written and read back from cache, never a whole-tensor copy in memory); Q and dO of
// one head in fp32 (MR-row panels for the A operands, column panels for the B operands); dK,
// dV accumulators of its keys; one head's dQ (one chunk) or the shared dQ partials (chunks x B
// x H x Lq x D fp32). Reads q, k, v, out, dout once per task (k, v: its keys only).
//
// bf16 at the AVX-512 level with AMX-BF16 or AVX512-BF16 (bf16_gemm.h): all five GEMMs on the
// bf16 instructions. S and dP from the inputs' bf16 rows
// (exact products), dQ += dS K with dS rounded to bf16, and dK, dV transposed so that the
// tiles' B operand is a tile's rows interleaved in query pairs: dV^T += dO^T P', dK^T += Q^T dS
// (P' and dS rounded to bf16, as FlashAttention rounds them; Q^T and dO^T in bf16 once per head),
// into fp32 dK^T / dV^T accumulators transposed back when the task writes its keys. Probabilities,
// dS and every accumulator stay fp32.
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/attention_scores.h"
#include "cpu/attention_sequences.h"
#include "cpu/attention_mask_structure.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

using namespace attn;

constexpr int64_t kMinTasks = 8;  // split keys into chunks until B * Hkv * chunks >= this

// What every task of a call shares.
template <typename T>
struct BwdCall {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const AttnArgs& a;
  Shape<A> sh;                      // (points at terms_table)
  const TermsTable<A> terms_table;  // ALiBi and the relative bias over j - i
  const int64_t n_chunks, kb_per_chunk;
  const int64_t dq_head;      // rows of one head's dQ accumulator: (Lq + kRowSlack) * D_pad
  // One chunk: a task sees every key of its heads, so it writes their dQ itself from one
  // per-thread accumulator. Several: fp32 partials per chunk, summed after all tasks.
  const bool task_owns_dq;
  A* dq_part = nullptr;       // the partials (several chunks)
  const uint32_t threshold;   // dropout
  const A drop_scale;         // 1 / (1 - p)
  const A* const lse;
  const A score_mul;          // scores in log2 units, see score_row
  // The float mask's gradient sums over the dims the mask broadcasts: tasks that would add
  // into the same entries run in one task instead (fold the batch, the kv heads; one key chunk
  // when it broadcasts over keys), so no two threads ever add to one entry.
  const bool fold_b, fold_h;
  const int64_t n_tasks;
  // (n_tasks, H, Lq + Lk - 1 + kRelSlack): each task's part of d rel_bias.
  A* drel_parts = nullptr;
  const int64_t drel_size;
  const MaskTiles mask_tiles;  // tiles a bool mask / the key padding masks or attends wholly

  static int64_t chunks_for(const AttnArgs& args, const Shape<A>& sh) {
    if (args.dmask && args.dmask_s[3] == 0) return 1;
    return std::clamp<int64_t>((kMinTasks + sh.B * sh.Hkv - 1) / (sh.B * sh.Hkv), 1, sh.n_kb);
  }

  explicit BwdCall(const AttnArgs& args)
      : a(args), sh(args), terms_table(args, sh), n_chunks(chunks_for(args, sh)),
        kb_per_chunk((sh.n_kb + n_chunks - 1) / n_chunks), dq_head((sh.Lq + kRowSlack) * sh.D_pad),
        task_owns_dq(n_chunks == 1), threshold(args.dropout_p > 0 ? dropout_threshold(args.dropout_p) : 0),
        drop_scale(args.dropout_p > 0 ? A(1) / static_cast<A>(1.0 - args.dropout_p) : A(1)),
        lse(static_cast<const A*>(args.lse)), score_mul(static_cast<A>(args.scale * kLog2e)),
        fold_b(args.dmask && args.dmask_s[0] == 0), fold_h(args.dmask && args.dmask_s[1] == 0),
        n_tasks((fold_b ? 1 : sh.B) * (fold_h ? 1 : sh.Hkv) * n_chunks),
        drel_size(sh.H * (sh.Lq + sh.Lk - 1 + kRelSlack)), mask_tiles(args, kBlockQ, kBlockK) {
    if (args.drel) {
      drel_parts = thread_scratch<A, Scratch::kBwdRelParts>(n_tasks * drel_size);
      std::fill(drel_parts, drel_parts + n_tasks * drel_size, A(0));
    }
    if (!task_owns_dq) {
      dq_part = thread_scratch<A, Scratch::kBwdDqPartials>(n_chunks * sh.B * sh.H * dq_head);
      std::fill(dq_part, dq_part + n_chunks * sh.B * sh.H * dq_head, A(0));
    }
  }

  // dQ row i of head bh = scale * (the sum of `parts` partial rows part[c * part_stride], in order).
  void store_dq_row(int64_t bh, int64_t i, const A* part, int64_t part_stride, int64_t parts) const {
    constexpr int64_t kV = V::size();
    const V dq_scale(static_cast<A>(a.scale));
    T* dq_row = const_cast<T*>(row_ptr<T>(a.dq, bh / sh.H, bh % sh.H, i));
    for (int64_t d = 0; d < sh.D; d += kV) {
      V sum = V::loadu(part + d);
      for (int64_t c = 1; c < parts; ++c) sum = sum + V::loadu(part + c * part_stride + d);
      store_acc(dq_row + d, sum * dq_scale, std::min(kV, sh.D - d));
    }
  }
};

// The keys of one task: key blocks [kb0, kb1) of kv head (b, hkv); task: its index.
struct TaskKeys {
  int64_t b, hkv, chunk, kb0, kb1, key0, n_keys, task;
};

// dK = scale * dS^T Q, dV as accumulated: rows [j0, j0 + n) of the task's keys from fp32
// accumulator rows (dk_rows / dv_rows, row strides D_pad / Dv_pad, row 0 = key j0).
template <typename T>
void store_key_rows(const BwdCall<T>& c, const TaskKeys& t, int64_t j0, int64_t n, const acc_t<T>* dk_rows,
                    const acc_t<T>* dv_rows) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  const Shape<A>& sh = c.sh;
  const V scale_v(static_cast<A>(c.a.scale));
  for (int64_t j = 0; j < n; ++j) {
    T* dk_row = const_cast<T*>(row_ptr<T>(c.a.dk, t.b, t.hkv, t.key0 + j0 + j));
    T* dv_row = const_cast<T*>(row_ptr<T>(c.a.dv, t.b, t.hkv, t.key0 + j0 + j));
    for (int64_t d = 0; d < sh.D; d += kV)
      store_acc(dk_row + d, V::loadu(dk_rows + j * sh.D_pad + d) * scale_v, std::min(kV, sh.D - d));
    for (int64_t d = 0; d < sh.Dv; d += kV)
      store_acc(dv_row + d, V::loadu(dv_rows + j * sh.Dv_pad + d), std::min(kV, sh.Dv - d));
  }
}

// The GEMMs of a task on the fp32 micro-kernel (every dtype; bf16 without bf16 GEMMs). Q and dO of the
// current head in MR-row panels (A operands of S and dP, one block of kQBlockRows per query
// block) and column panels (B operands of dK and dV); K^T, V^T and K of the task's key blocks
// packed (Packed); dK, dV accumulated in fp32 rows of the task's keys.
template <typename T>
struct Fp32Grads {
  using A = acc_t<T>;
  static constexpr int64_t MR = MicroShape<A>::kMR, NR = MicroShape<A>::kNR;
  const Shape<A>& sh;
  const int64_t q_rows, q_pk_block, do_pk_block;
  A* const q_pk;      // Q, MR-row panels (A operand)
  A* const do_pk;     // dO, MR-row panels
  A* const q_stage;   // one MR-row panel's Q rows
  A* const q_p;       // Q, column panels (B operand)
  A* const do_p;      // dO, column panels
  A* const dk_acc;
  A* const dv_acc;
  Packed<A> packing;  // the task's key blocks (see Packed); read-only below

  Fp32Grads(const BwdCall<T>& c, const TaskKeys& t, Bf16Gemm)
      : sh(c.sh), q_rows(sh.Lq + kRowSlack), q_pk_block(kQBlockRows<A> * sh.D), do_pk_block(kQBlockRows<A> * sh.Dv),
        q_pk(thread_scratch<A, Scratch::kBwdQPanels>(sh.n_qb * q_pk_block)),
        do_pk(thread_scratch<A, Scratch::kBwdDoPanels>(sh.n_qb * do_pk_block)),
        q_stage(thread_scratch<A, Scratch::kBwdQStage>(MR * sh.D_pad)),
        q_p(thread_scratch<A, Scratch::kBwdQCols>(q_rows * sh.D_pad)),
        do_p(thread_scratch<A, Scratch::kBwdDoCols>(q_rows * sh.Dv_pad)),
        dk_acc(thread_scratch<A, Scratch::kBwdDkAcc>((t.n_keys + kRowSlack) * sh.D_pad)),
        dv_acc(thread_scratch<A, Scratch::kBwdDvAcc>((t.n_keys + kRowSlack) * sh.Dv_pad)),
        packing(sh, 1, t.kb1 - t.kb0, /*backward=*/true, false) {
    static_assert(kBlockQ % MR == 0 && MR <= kRowSlack, "query blocks are whole panels, the last one within the slack rows");
    for (int64_t kb = t.kb0; kb < t.kb1; ++kb) pack_kv_block<T, A>(c.a, sh, packing, t.b, t.hkv, kb, 0, kb - t.kb0);
    // Accumulators: only the chunk's rows are read or written (GEMMs store valid rows only).
    std::fill(dk_acc, dk_acc + t.n_keys * sh.D_pad, A(0));
    std::fill(dv_acc, dv_acc + t.n_keys * sh.Dv_pad, A(0));
  }

  // Row i of head (b, h) (rows past Lq are zero; do_i is dO's fp32 row, staged as row i % MR of
  // a panel): the column panels, and the MR-row panels once a panel's last row is in.
  void put_row(const AttnArgs& a, int64_t b, int64_t h, int64_t i, const A* do_stage, const A* do_i) {
    A* const q_i = q_stage + (i % MR) * sh.D_pad;
    if (i < sh.Lq) load_row(row_ptr<T>(a.q, b, h, i), sh.D, sh.D_pad, q_i);
    else std::fill(q_i, q_i + sh.D_pad, A(0));
    put_row_panels(q_p, q_rows, i, q_i, sh.D_pad);
    put_row_panels(do_p, q_rows, i, do_i, sh.Dv_pad);
    const int64_t panel0 = i / MR * MR;
    if (i % MR == MR - 1 && panel0 < sh.Lq) {
      const int64_t at = (panel0 % kBlockQ) * sh.D, at_do = (panel0 % kBlockQ) * sh.Dv;
      put_mr_panel(q_stage, sh.D_pad, sh.D, q_pk + (panel0 / kBlockQ) * q_pk_block + at);
      put_mr_panel(do_stage, sh.Dv_pad, sh.Dv, do_pk + (panel0 / kBlockQ) * do_pk_block + at_do);
    }
  }
  void head_done() {}

  // S = Q K^T into p_tile, dP = dO V^T into ds_tile.
  void scores(int64_t q0, int64_t n_q, int64_t blk, int64_t cols, A* p_tile, A* ds_tile, Band band) const {
    const int64_t qb = q0 / kBlockQ;
    tile_gemm<A, 1, MR>(n_q, cols, sh.D, q_pk + qb * q_pk_block, 1, MR, packing.kt_block(0, blk), NR, sh.D * NR,
                        p_tile, kScoreLd, false, band, sh.D * MR);
    tile_gemm<A, 1, MR>(n_q, cols, sh.Dv, do_pk + qb * do_pk_block, 1, MR, packing.vt_block(0, blk), NR, sh.Dv * NR,
                        ds_tile, kScoreLd, false, band, sh.Dv * MR);
  }

  // dV += P'^T dO, dK += dS^T Q (transposed views of the tiles), dQ += dS K.
  void grads(int64_t q0, int64_t n_q, int64_t blk, int64_t k_local, int64_t n_keys, int64_t, const A* pd_tile,
             const A* ds_tile, A* dq, Band keys_band, Band inner_band) const {
    A* const dk_blk = dk_acc + k_local * sh.D_pad;
    A* const dv_blk = dv_acc + k_local * sh.Dv_pad;
    tile_gemm<A, 1, kScoreLd>(n_keys, sh.Dv, n_q, pd_tile, 1, kScoreLd, do_p + q0 * NR, NR, q_rows * NR, dv_blk,
                              sh.Dv_pad, true, keys_band);
    tile_gemm<A, 1, kScoreLd>(n_keys, sh.D, n_q, ds_tile, 1, kScoreLd, q_p + q0 * NR, NR, q_rows * NR, dk_blk,
                              sh.D_pad, true, keys_band);
    tile_gemm<A, kScoreLd, 1>(n_q, sh.D, n_keys, ds_tile, kScoreLd, 1, packing.kp_block(0, blk), NR,
                              sh.Bk_pad * NR, dq + q0 * sh.D_pad, sh.D_pad, true, inner_band);
  }

  void store_keys(const BwdCall<T>& c, const TaskKeys& t) const { store_key_rows(c, t, 0, t.n_keys, dk_acc, dv_acc); }
};

// The GEMMs of a task on bf16 instructions (bf16 inputs, bf16_gemm.h). Q and dO's bf16 rows (A of S and
// dP; zero rows past Lq, qt_cols of them) and their transposes (A of dK^T and dV^T; zero
// columns past Lq, a query block's 32-rounded range within qt_cols); P' and dS rounded to bf16
// (rows of kBlockK, zero rows up to a multiple of 32) and interleaved in query pairs; dK^T and
// dV^T accumulators (keys_ld columns: the chunk's key blocks), transposed back when the task
// writes its keys.
template <typename T>
struct Bf16Grads {
  using A = acc_t<T>;
  static constexpr int64_t kQBlockRows32 = (kBlockQ + 31) / 32 * 32;
  const Shape<A>& sh;
  const Bf16Gemm kind;
  const int64_t q_rows, qt_cols, keys_ld;
  c10::BFloat16* const q_bf16;
  c10::BFloat16* const do_bf16;
  c10::BFloat16* const qt_bf16;
  c10::BFloat16* const dot_bf16;
  uint32_t* const t_words;
  c10::BFloat16* const p_bf16;
  c10::BFloat16* const ds_bf16;
  uint32_t* const p_pairs;
  uint32_t* const ds_pairs;
  A* const dkt_acc;
  A* const dvt_acc;
  A* const dk_rows;  // 8 keys of dK / dV transposed back, see store_keys
  A* const dv_rows;
  Packed<A> packing;

  Bf16Grads(const BwdCall<T>& c, const TaskKeys& t, Bf16Gemm gemm_kind)
      : sh(c.sh), kind(gemm_kind), q_rows(sh.Lq + kRowSlack), qt_cols(round_up_to(sh.Lq, 16) + 32),
        keys_ld((t.kb1 - t.kb0) * kBlockK),
        q_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdQBf16>(qt_cols * sh.D_bf16)),
        do_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdDoBf16>(qt_cols * sh.Dv_bf16)),
        qt_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdQtBf16>(sh.D_bf16 * qt_cols)),
        dot_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdDotBf16>(sh.Dv_bf16 * qt_cols)),
        t_words(thread_scratch<uint32_t, Scratch::kBwdTransposeWords>(qt_cols * std::max(sh.D_bf16, sh.Dv_bf16) / 2)),
        p_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdPBf16>(kQBlockRows32 * kBlockK)),
        ds_bf16(thread_scratch<c10::BFloat16, Scratch::kBwdDsBf16>(kQBlockRows32 * kBlockK)),
        p_pairs(thread_scratch<uint32_t, Scratch::kBwdPPairs>(kQBlockRows32 * kBlockK / 2)),
        ds_pairs(thread_scratch<uint32_t, Scratch::kBwdDsPairs>(kQBlockRows32 * kBlockK / 2)),
        dkt_acc(thread_scratch<A, Scratch::kBwdDktAcc>(sh.D_bf16 * keys_ld)),
        dvt_acc(thread_scratch<A, Scratch::kBwdDvtAcc>(sh.Dv_bf16 * keys_ld)),
        dk_rows(thread_scratch<A, Scratch::kBwdDkAcc>((8 + kRowSlack) * sh.D_pad)),
        dv_rows(thread_scratch<A, Scratch::kBwdDvAcc>((8 + kRowSlack) * sh.Dv_pad)),
        packing(sh, 1, t.kb1 - t.kb0, /*backward=*/true, true) {
    TORCH_INTERNAL_ASSERT(sh.D_bf16 == sh.D_pad, "bf16 dQ tiles write rows D_pad wide");
    for (int64_t kb = t.kb0; kb < t.kb1; ++kb) pack_kv_block<T, A>(c.a, sh, packing, t.b, t.hkv, kb, 0, kb - t.kb0);
    std::fill(dkt_acc, dkt_acc + sh.D_bf16 * keys_ld, A(0));
    std::fill(dvt_acc, dvt_acc + sh.Dv_bf16 * keys_ld, A(0));
    std::fill(q_bf16 + q_rows * sh.D_bf16, q_bf16 + qt_cols * sh.D_bf16, c10::BFloat16(0.0f));
    std::fill(do_bf16 + q_rows * sh.Dv_bf16, do_bf16 + qt_cols * sh.Dv_bf16, c10::BFloat16(0.0f));
  }

  void put_row(const AttnArgs& a, int64_t b, int64_t h, int64_t i, const A*, const A*) {
    c10::BFloat16* const q_row = q_bf16 + i * sh.D_bf16;
    c10::BFloat16* const do_row = do_bf16 + i * sh.Dv_bf16;
    if (i < sh.Lq) {
      put_bf16_row(row_ptr<c10::BFloat16>(a.q, b, h, i), sh.D, sh.D_bf16, q_row);
      put_bf16_row(row_ptr<c10::BFloat16>(a.dout, b, h, i), sh.Dv, sh.Dv_bf16, do_row);
    } else {
      std::fill(q_row, q_row + sh.D_bf16, c10::BFloat16(0.0f));
      std::fill(do_row, do_row + sh.Dv_bf16, c10::BFloat16(0.0f));
    }
  }
  void head_done() {
    transpose_bf16(q_bf16, sh.D_bf16, qt_cols, sh.D_bf16, qt_bf16, qt_cols, t_words);
    transpose_bf16(do_bf16, sh.Dv_bf16, qt_cols, sh.Dv_bf16, dot_bf16, qt_cols, t_words);
  }

  void scores(int64_t q0, int64_t n_q, int64_t blk, int64_t cols, A* p_tile, A* ds_tile, Band band) const {
    tile_gemm_bf16(kind, n_q, cols, sh.D_bf16, q_bf16 + q0 * sh.D_bf16, sh.D_bf16, packing.kw_block(0, blk), p_tile, kScoreLd,
                  false, band);
    tile_gemm_bf16(kind, n_q, cols, sh.Dv_bf16, do_bf16 + q0 * sh.Dv_bf16, sh.Dv_bf16, packing.vw_block(0, blk), ds_tile,
                  kScoreLd, false, band);
  }

  // dV^T += dO^T P', dK^T += Q^T dS over the block's queries rounded up to 32 (the rows past n_q
  // zero), whole tiles (P' and dS are 0 above the diagonal); dQ += dS K.
  void grads(int64_t q0, int64_t n_q, int64_t blk, int64_t k_local, int64_t, int64_t cols, const A* pd_tile,
             const A* ds_tile, A* dq, Band, Band inner_band) const {
    const int64_t n_q32 = round_up_to(n_q, 32);
    for (int64_t i = 0; i < n_q; ++i) {
      round_row_to_bf16(pd_tile + i * kScoreLd, cols, p_bf16 + i * kBlockK);
      round_row_to_bf16(ds_tile + i * kScoreLd, cols, ds_bf16 + i * kBlockK);
    }
    std::fill(p_bf16 + n_q * kBlockK, p_bf16 + n_q32 * kBlockK, c10::BFloat16(0.0f));
    std::fill(ds_bf16 + n_q * kBlockK, ds_bf16 + n_q32 * kBlockK, c10::BFloat16(0.0f));
    put_row_pairs_panels(p_bf16, kBlockK, n_q32, cols, p_pairs);
    put_row_pairs_panels(ds_bf16, kBlockK, n_q32, cols, ds_pairs);
    tile_gemm_bf16(kind, sh.Dv_bf16, cols, n_q32, dot_bf16 + q0, qt_cols, p_pairs, dvt_acc + k_local, keys_ld, true, Band{});
    tile_gemm_bf16(kind, sh.D_bf16, cols, n_q32, qt_bf16 + q0, qt_cols, ds_pairs, dkt_acc + k_local, keys_ld, true, Band{});
    tile_gemm_bf16(kind, n_q, sh.D_bf16, cols, ds_bf16, kBlockK, packing.kpw_block(0, blk), dq + q0 * sh.D_pad, sh.D_pad,
                  true, inner_band);
  }

  // From the transposed accumulators, 8 keys at a time through 8 x 8 transposes into rows.
  void store_keys(const BwdCall<T>& c, const TaskKeys& t) const {
    for (int64_t j0 = 0; j0 < t.n_keys; j0 += 8) {
      for (int64_t d = 0; d < sh.D_bf16; d += 8) transpose_8x8<A>(dkt_acc + d * keys_ld + j0, keys_ld, dk_rows + d, sh.D_pad);
      for (int64_t d = 0; d < sh.Dv_bf16; d += 8) transpose_8x8<A>(dvt_acc + d * keys_ld + j0, keys_ld, dv_rows + d, sh.Dv_pad);
      store_key_rows(c, t, j0, std::min<int64_t>(8, t.n_keys - j0), dk_rows, dv_rows);
    }
  }
};

// delta_i = sum_d dO_id O_id, O read in place (dO's padding columns are zero); bf16 / fp16
// with the forward's rounding residual: O = out + residual, the fp32 output (store_out_row).
template <typename T, typename A>
A row_delta(const AttnArgs& a, int64_t b, int64_t h, int64_t i, const A* do_i) {
  using V = Vectorized<A>;
  const T* const o_row = row_ptr<T>(a.out, b, h, i);
  const T* const r_row = a.out_residual.ptr ? row_ptr<T>(a.out_residual, b, h, i) : nullptr;
  V sum(A(0));
  for (int64_t d = 0; d < a.Dv; d += V::size()) {
    const int64_t n = std::min<int64_t>(V::size(), a.Dv - d);
    auto load = [&](const T* p) { return n == V::size() ? load_acc(p + d) : load_acc(p + d, n); };
    V o = load(o_row);
    if constexpr (is_reduced_v<T>) {
      if (r_row) o = o + load(r_row);
    }
    sum = at::vec::fmadd(o, V::loadu(do_i + d), sum);
  }
  return reduce_add(sum);
}

// One task: every query head of kv head (b, hkv) against the task's keys, shared by both GEMM
// paths: per head, Q / dO staged and delta computed; per (key block, query block that can see
// it) tile, the score GEMMs, P and dS row by row, the gradient GEMMs.
template <typename T, class Grads>
void backward_task(const BwdCall<T>& c, const TaskKeys& t, Bf16Gemm kind) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t kV = V::size();
  constexpr int64_t MR = MicroShape<A>::kMR;
  const AttnArgs& a = c.a;
  const Shape<A>& sh = c.sh;
  const int64_t b = t.b;
  const int64_t q_rows = sh.Lq + kRowSlack;
  Grads gemms(c, t, kind);
  A* const do_stage = thread_scratch<A, Scratch::kBwdDoStage>(MR * sh.Dv_pad);  // one MR-row panel's rows
  A* const p_tile = thread_scratch<A, Scratch::kBwdP>((kBlockQ + kRowSlack) * kScoreLd);
  A* const ds_tile = thread_scratch<A, Scratch::kBwdDs>((kBlockQ + kRowSlack) * kScoreLd);
  A* const pd_tile = c.threshold ? thread_scratch<A, Scratch::kBwdPDropped>((kBlockQ + kRowSlack) * kScoreLd) : p_tile;
  A* const bias = thread_scratch<A, Scratch::kBwdBias>(sh.Bk_pad + kV);
  A* const d_cap = sh.cap_out != A(0) ? thread_scratch<A, Scratch::kBwdSoftcapGrad>(sh.Bk_pad + kV) : nullptr;
  A* const d_rel = a.drel ? c.drel_parts + t.task * c.drel_size : nullptr;  // this task's part
  A* const delta_h = thread_scratch<A, Scratch::kBwdDelta>(sh.Lq);  // delta of the current head
  A* const dq_own = c.task_owns_dq ? thread_scratch<A, Scratch::kBwdDqOwn>(c.dq_head) : nullptr;

  // Every head rewrites the staged Q / dO a tile reads (rows past Lq from zero rows).
  for (int64_t g = 0; g < sh.G; ++g) {
    const int64_t h = t.hkv * sh.G + g;
    for (int64_t i = 0; i < q_rows; ++i) {
      A* const do_i = do_stage + (i % MR) * sh.Dv_pad;
      if (i < sh.Lq) {
        load_row(row_ptr<T>(a.dout, b, h, i), sh.Dv, sh.Dv_pad, do_i);
        delta_h[i] = row_delta<T>(a, b, h, i, do_i);
      } else {
        std::fill(do_i, do_i + sh.Dv_pad, A(0));
      }
      gemms.put_row(a, b, h, i, do_stage, do_i);
    }
    gemms.head_done();
    A* const dq = c.task_owns_dq ? dq_own : c.dq_part + (t.chunk * sh.B * sh.H + b * sh.H + h) * c.dq_head;
    if (c.task_owns_dq) std::fill(dq, dq + sh.Lq * sh.D_pad, A(0));  // rows < Lq are used
    const A* lse_h = c.lse + b * a.lse_s[0] + h * a.lse_s[1];
    if (a.dsinks && t.chunk == 0) {
      // d sink = -sum_i p_sink,i delta_i, p_sink = exp(sink - lse): once per (b, h).
      const A sink = static_cast<const A*>(a.sinks)[h];
      A sum = 0;
      for (int64_t i = 0; i < sh.Lq; ++i) sum += std::exp(sink - lse_h[i]) * delta_h[i];
      static_cast<A*>(a.dsinks)[b * sh.H + h] = -sum;
    }

    for (int64_t kb = t.kb0; kb < t.kb1; ++kb) {
      const int64_t k0 = kb * kBlockK, n_keys = sh.block_keys(kb), cols = sh.block_cols(n_keys);
      // Query blocks that can see key block kb (the band: causality, the window).
      const int64_t q_end = sh.q_end(kb);
      for (int64_t q0 = sh.q_begin(kb) / kBlockQ * kBlockQ; q0 < q_end; q0 += kBlockQ) {
        const MaskTiles::State mask_state = c.mask_tiles.at(b, h, q0, kb);
        if (mask_state == MaskTiles::kDead) continue;
        const int64_t n_q = std::min(kBlockQ, sh.Lq - q0);
        const bool diagonal = sh.diagonal(q0, kb), cut = sh.cut(q0, q0 + n_q, kb);
        // Diagonal tiles: micro-tiles wholly above the diagonal are skipped in all five GEMMs.
        gemms.scores(q0, n_q, kb - t.kb0, cols, p_tile, ds_tile, sh.band(q0, q0 + n_q, kb, Band::kColsUpTo));
        // P exactly as the forward computed it (Shape::unmasked): straight from S with one FMA
        // (exp2_row's mul), or after score_row's transform and bias. Unmasked tiles without
        // dropout (most of them): P and dS in one pass over the row.
        const bool unmasked = sh.unmasked(q0, q0 + n_q, kb, c.score_mul, mask_state == MaskTiles::kFull);
        const bool plain_tile = unmasked && !c.threshold;
        const bool shared_bias = sh.shared_bias(a, q0, q0 + n_q, kb);
        for (int64_t i = 0; i < n_q; ++i) {
          A* p = p_tile + i * kScoreLd;
          A* ds = ds_tile + i * kScoreLd;
          const A lse_log2 = lse_h[q0 + i] * static_cast<A>(kLog2e);
          const V delta_v(delta_h[q0 + i]);
          if (plain_tile) {
            // P = 2^(scale log2(e) S - log2(e) lse) (<= 0 up to rounding), dS = P (dP - delta)
            const V mul_v(c.score_mul), neg_shift(-lse_log2);
            for (int64_t j = 0; j < cols; j += kV) {
              const V p_v = exp2_nonpositive(at::vec::fmadd(V::loadu(p + j), mul_v, neg_shift));
              p_v.store(p + j);
              (p_v * (V::loadu(ds + j) - delta_v)).store(ds + j);
            }
            continue;
          }
          const int64_t qi = q0 + i;
          // The row's slice of d rel_bias: entry j is key k0 + j's.
          A* const d_rel_row = d_rel ? d_rel + h * (sh.Lq + sh.Lk - 1 + kRelSlack) + (k0 - qi + sh.Lq - 1) : nullptr;
          if (!unmasked && !sh.bias_row && !c.threshold) {  // band, softcap, inline terms: one pass
            p_ds_row(a, sh, p, ds, c.score_mul, b, h, qi, k0, n_keys, cols, cut, lse_log2, delta_h[qi], d_rel_row);
            continue;
          }
          if (unmasked) {
            exp2_row(p, cols, lse_log2, c.score_mul);  // P = exp(scale S - lse)
          } else {
            score_row(a, sh, p, c.score_mul, b, h, q0 + i, k0, n_keys, cols, cut, bias, d_cap, shared_bias && i > 0);
            exp2_row(p, cols, lse_log2);  // P = exp(s - lse)
          }
          if (diagonal) {
            // Entries past the row's last allowed key may be unwritten: dS (and P) there are 0.
            const int64_t live = round_up_to(sh.hi_end(q0 + i, k0, cols), kV);
            std::fill(ds + live, ds + cols, A(0));
          }
          // So may entries before the row's first one (a window's lower edge).
          const int64_t first_live = cut ? sh.lo_begin(q0 + i, k0, n_keys) : 0;
          if (c.threshold) {
            // dS = P (dP keep/(1-p) - delta); dV uses P' = P keep/(1-p)
            A* pd = pd_tile + i * kScoreLd;
            std::copy(p, p + cols, pd);
            drop_row(a, pd, b, h, q0 + i, k0, n_keys, c.threshold);
            const V scale_v(c.drop_scale);
            for (int64_t j = 0; j < cols; j += kV) {
              const V kept = V::loadu(pd + j) * scale_v;  // P'
              const V p_v = V::loadu(p + j);
              // dP' = dP * keep/(1-p) = dP * P'/P where P > 0; dS = P dP' - P delta
              const V dp_kept = V::blendv(V::loadu(ds + j) * scale_v, V(A(0)), kept == V(A(0)));
              (p_v * (dp_kept - delta_v)).store(ds + j);
              kept.store(pd + j);
            }
          } else {
            for (int64_t j = 0; j < cols; j += kV)
              (V::loadu(p + j) * (V::loadu(ds + j) - delta_v)).store(ds + j);
          }
          std::fill(ds, ds + first_live, A(0));
          // dS is the gradient of the biased score: of the float mask and of the relative bias
          // (summed where they broadcast). The softcap's derivative comes after: the biases
          // are added to the capped score.
          if (a.dmask) {
            const int64_t at = b * a.dmask_s[0] + h * a.dmask_s[1] + qi * a.dmask_s[2] + k0 * a.dmask_s[3];
            if (a.dmask_in_dtype) {  // this row's entries get no other contribution; they are
              T* dm = static_cast<T*>(a.dmask) + at;  // contiguous (or one key: Lk = 1)
              for (int64_t j = 0; j < n_keys; j += kV) store_acc(dm + j, V::loadu(ds + j), std::min(kV, n_keys - j));
            } else {
              A* dm = static_cast<A*>(a.dmask) + at;
              for (int64_t j = 0; j < n_keys; ++j) dm[j * a.dmask_s[3]] += ds[j];
            }
          }
          if (d_rel_row)
            for (int64_t j = 0; j < cols; j += kV) (V::loadu(d_rel_row + j) + V::loadu(ds + j)).store(d_rel_row + j);
          if (d_cap)
            for (int64_t j = 0; j < cols; j += kV) (V::loadu(ds + j) * V::loadu(d_cap + j)).store(ds + j);
        }
        gemms.grads(q0, n_q, kb - t.kb0, k0 - t.key0, n_keys, cols, pd_tile, ds_tile, dq,
                    sh.band(q0, q0 + n_q, kb, Band::kInnerFrom), sh.band(q0, q0 + n_q, kb, Band::kInnerUpTo));
      }
    }
    if (c.task_owns_dq)
      for (int64_t i = 0; i < sh.Lq; ++i) c.store_dq_row(b * sh.H + h, i, dq + i * sh.D_pad, 0, 1);
  }
  gemms.store_keys(c, t);
}

template <typename T>
void attention_bwd_typed(const AttnArgs& a) {
  using A = acc_t<T>;
  if (a.cu_q) {  // one call per sequence; the gradients of rows that see nothing are 0
    for (const AttnArgs& s : split_sequences(a)) {
      if (s.Lq > 0 && s.Lk > 0) {
        attention_bwd_typed<T>(s);
        continue;
      }
      zero_rows<T>(s.dq, s.H, s.Lq, s.D);
      zero_rows<T>(s.dk, s.Hkv, s.Lk, s.D);
      zero_rows<T>(s.dv, s.Hkv, s.Lk, s.Dv);
    }
    return;
  }
  if (AttnArgs band = a; fold_band_mask(band)) return attention_bwd_typed<T>(band);
  const BwdCall<T> c(a);
  const Shape<A>& sh = c.sh;
  // bf16 on AMX-BF16 or AVX512-BF16: all five GEMMs on them (Bf16Grads); else the fp32
  // micro-kernel.
  const Bf16Gemm kind = std::is_same_v<T, c10::BFloat16> ? bf16_gemm() : Bf16Gemm::kFp32;
  const double flops = 2.5 * 2.0 * sh.B * sh.H * sh.Lq * sh.Lk * (sh.D + sh.Dv);
  const int64_t task_hkv = c.fold_h ? 1 : sh.Hkv;
  parallel_tasks(c.n_tasks, flops, [&](int64_t task) {
    const int64_t chunk = task % c.n_chunks, bhkv = task / c.n_chunks;
    TaskKeys t{0, 0, chunk, chunk * c.kb_per_chunk, 0, 0, 0, task};
    t.kb1 = std::min(sh.n_kb, t.kb0 + c.kb_per_chunk);
    if (t.kb0 >= t.kb1) return;
    t.key0 = t.kb0 * kBlockK;
    t.n_keys = std::min(sh.Lk, t.kb1 * kBlockK) - t.key0;
    const AmxTiles tiles(kind);
    const int64_t b0 = c.fold_b ? 0 : bhkv / task_hkv, b1 = c.fold_b ? sh.B : b0 + 1;
    const int64_t h0 = c.fold_h ? 0 : bhkv % task_hkv, h1 = c.fold_h ? sh.Hkv : h0 + 1;
    for (t.b = b0; t.b < b1; ++t.b) {
      for (t.hkv = h0; t.hkv < h1; ++t.hkv) {
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (kind != Bf16Gemm::kFp32) {
            backward_task<T, Bf16Grads<T>>(c, t, kind);
            continue;
          }
        }
        backward_task<T, Fp32Grads<T>>(c, t, kind);
      }
    }
  });

  // d rel_bias = the tasks' parts, summed in task order (the layout of a.drel: padded rows).
  if (a.drel) {
    A* const drel = static_cast<A*>(a.drel);
    for (int64_t x = 0; x < c.drel_size; ++x) {
      A sum = 0;
      for (int64_t task = 0; task < c.n_tasks; ++task) sum += c.drel_parts[task * c.drel_size + x];
      drel[x] = sum;
    }
  }

  // dQ = scale * the sum over chunks (in chunk order) of the partials.
  if (!c.task_owns_dq) {
    at::parallel_for(0, sh.B * sh.H * sh.Lq, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r % sh.Lq, bh = r / sh.Lq;
        c.store_dq_row(bh, i, c.dq_part + bh * c.dq_head + i * sh.D_pad, sh.B * sh.H * c.dq_head, c.n_chunks);
      }
    });
  }
}

}  // namespace

void attention_bwd(const AttnArgs& args) {
  dispatch_dtype(args.dtype, [&](auto tag) { attention_bwd_typed<decltype(tag)>(args); });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
