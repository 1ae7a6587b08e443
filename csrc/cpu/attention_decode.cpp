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
// and writes its rows' (max, sum, acc) for its split. With fewer than kTasksWithoutSplits
// (batch row, kv head) tasks the keys of a call are split into pieces of kBlocksPerSplit key
// blocks (a cache of 4096 keys: 6 tasks per kv head, so batch 1 with few kv heads still uses
// every core; the split depends on the shapes only, not on the thread count, and costs
// (splits * Dv) partials per row beside 2 * Lk * D keys read); the splits of a row are merged
// in split order by their log-sum-exp (out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M),
// M = max_s m_s; a sink joins the merged denominator), a deterministic result for any thread
// count. With one split the task writes the output itself.
// Memory: K and V of a kv head read once per call (memory-bound: 2 * Lk * D per kv head),
// Q, out and the partials O(B * H * Lq * (D + splits * Dv)).
// Variable key lengths (k_lens, a KV cache; k_starts, its left padding) and paged caches
// (block_table) are read directly.
// One query row per task (multi-head attention decoding a token) skips the GEMMs, in every
// dtype: scores as dot products with the cache's key rows and P V as axpys of its value rows,
// in place, in fp32 (DecodeRowGemms). Otherwise the two GEMMs of a key block, per dtype and level:
//   - fp32 micro-kernel (DecodeFp32Gemms; every dtype, bf16 without bf16 instructions): the block's K
//     and V converted into fp32 K^T / V panels (pack_kv_block), Q in MR-row panels;
//   - bf16 instructions (DecodeBf16Gemms; bf16 at the AVX-512 level with AMX-BF16 or
//     AVX512-BF16, bf16_gemm.h): S^T = K_block Q^T with the cache's key rows as the A operand,
//     read in place by the tile loads 16 keys at a time (no packing of K), and acc += P V with
//     V's rows interleaved in pairs straight from the cache, P as the sum of two bf16 parts
//     (measured: see DecodeBf16Gemms).
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/attention_scores.h"
#include "cpu/bf16_gemm.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace {

using namespace attn;

constexpr int64_t kBlocksPerSplit = 4;  // 768 keys
// From this many (batch row, kv head) tasks the keys are not split: the tasks alone fill the
// threads, each thread takes a fixed contiguous range of them (the same heads every call, so a
// cache it read last call may still be in its core's L2), and no partials are merged. MHA fp32
// (1, 16, 1, 64) against 1024 / 4096 keys, 2-core Xeon: 242 -> 219 / 891 -> 729 us (SDPA
// 176 / 835).
constexpr int64_t kTasksWithoutSplits = 16;

// A task's GEMMs on the fp32 micro-kernel: Q's R rows in MR-row panels, each key block packed
// into fp32 K^T / V panels in the thread's cache. At most kNarrowMR rows (a GQA group of 4 or
// fewer decoding one token, MHA's single row) run the narrow micro-tile from Q's rows as they
// are: the full one computes 12 rows whatever R is. fp32 (1, 16/4 heads, 1, 64) against 2100
// keys on the 2-core AMX Xeon, two threads: 297 us on the full tile, 201 on the narrow one
// (torch SDPA 285).
template <typename T>
struct DecodeFp32Gemms {
  using A = acc_t<T>;
  static constexpr int64_t MR = MicroShape<A>::kMR, NR = MicroShape<A>::kNR;
  static constexpr int64_t kRowAlign = MR;  // rows of the score tile and acc the GEMMs write
  const AttnArgs& a;
  const Shape<A>& sh;
  const int64_t R;
  const bool narrow;  // R <= kNarrowMR: the narrow micro-tile over q_rows
  A* const q_rows;    // one panel's rows, staged (narrow: Q's rows, zero rows up to kNarrowMR)
  A* const q_packed;  // MR-row panels
  Packed<A> pk;

  DecodeFp32Gemms(const AttnArgs& args, const Shape<A>& shape, int64_t rows, Bf16Gemm)
      : a(args), sh(shape), R(rows), narrow(rows <= kNarrowMR),
        q_rows(thread_scratch<A, Scratch::kDecQStage>(MR * shape.D_pad)),
        q_packed(thread_scratch<A, Scratch::kDecQPanels>(round_up_to(rows, MR) * shape.D)),
        pk(shape, 1, 1, /*backward=*/false, /*pairs=*/false) {
    pk.k_norm2 = nullptr;  // (no score bounds here: every block's rows take the max pass)
  }

  // Row r = g * Lq + i is query i of head hkv * G + g.
  void load_q(int64_t b, int64_t hkv) {
    static_assert(kNarrowMR <= MR, "q_rows holds the narrow tile's rows");
    for (int64_t p0 = 0; p0 < R; p0 += MR) {
      for (int64_t r = 0; r < MR; ++r) {
        A* q_row = q_rows + r * sh.D_pad;
        const int64_t row = p0 + r;
        if (row < R) load_row(row_ptr<T>(a.q, b, hkv * sh.G + row / a.Lq, row % a.Lq), sh.D, sh.D_pad, q_row);
        else std::fill(q_row, q_row + sh.D_pad, A(0));
      }
      if (!narrow) put_mr_panel(q_rows, sh.D_pad, sh.D, q_packed + p0 * sh.D);
    }
  }
  void scores(int64_t b, int64_t hkv, int64_t kb, int64_t, int64_t cols, A* s_tile) {
    pack_kv_block<T, A>(a, sh, pk, b, hkv, kb, 0, 0);
    if (narrow) {
      tile_gemm<A, 0, 1, kNarrowMR>(R, cols, sh.D, q_rows, sh.D_pad, 1, pk.kt_block(0, 0), NR, sh.D * NR, s_tile,
                                    kScoreLd, false, Band{});
      return;
    }
    tile_gemm<A, 1, MR>(R, cols, sh.D, q_packed, 1, MR, pk.kt_block(0, 0), NR, sh.D * NR, s_tile, kScoreLd, false,
                        Band{}, sh.D * MR);
  }
  void p_row(const A*, int64_t, int64_t) {}  // P is read from the score tile itself
  void pv(int64_t, int64_t, int64_t, int64_t n_keys, int64_t, const A* s_tile, A* acc, bool accumulate) const {
    if (narrow) {
      tile_gemm<A, kScoreLd, 1, kNarrowMR>(R, sh.Dv, n_keys, s_tile, kScoreLd, 1, pk.vp_block(0, 0), NR,
                                           sh.Bk_pad * NR, acc, sh.Dv_pad, accumulate, Band{});
      return;
    }
    tile_gemm<A, kScoreLd, 1>(R, sh.Dv, n_keys, s_tile, kScoreLd, 1, pk.vp_block(0, 0), NR, sh.Bk_pad * NR, acc,
                              sh.Dv_pad, accumulate, Band{});
  }
};

// A task of one query row (multi-head attention decoding one token: G * Lq = 1) on the
// cache's rows read in place: the scores are dot products of q with the key rows, P V an axpy
// of the value rows into acc. The micro-kernel path above packs each key block into K^T / V
// panels for a one-row tile (the cache's bytes read, written and read again); fp32 (1, 16, 1,
// 64) against 280 keys on the 2-core AMX Xeon took 157 us there, 93 here on one thread (SDPA
// 38); 4096 keys 1160 us there, 748 here (SDPA 900). bf16 (the values widened to fp32 as they
// load) against the bf16 GEMMs' path, whose tiles are 16 query rows of which one is used: 280
// keys 102 -> 57 us, 1024 keys 214 -> 158 (ff.attention_with_kvcache; SDPA 23 / 73). The dot
// products of 16 keys at a time summed by one transposing add tree (lane_sums) and P V's
// accumulators kept in registers across a block's keys: the kernel alone (_C.attention_fwd),
// bf16 (1, 16, 1, 64) against 280 keys, 24.5 -> 17.4 us on two threads, 40.8 -> 29.0 on one
// (with reduce_add per key and acc through memory per key); GCC keeps the 16 accumulators in
// registers only with the key loops unrolled (#pragma GCC unroll; without: 21.8 us).
// Value rows outside [first_seen_key, end_seen_key) are not read (as the bf16 path's).
template <typename T>
struct DecodeRowGemms {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  static constexpr int64_t kRowAlign = 1;
  const AttnArgs& a;
  const Shape<A>& sh;
  A* const q_row;  // D_pad values, zero padded

  DecodeRowGemms(const AttnArgs& args, const Shape<A>& shape, int64_t, Bf16Gemm)
      : a(args), sh(shape), q_row(thread_scratch<A, Scratch::kDecQStage>(shape.D_pad + V::size())) {}

  void load_q(int64_t b, int64_t hkv) {
    load_row(row_ptr<T>(a.q, b, hkv * sh.G, 0), sh.D, sh.D_pad, q_row);
    std::fill(q_row + sh.D_pad, q_row + sh.D_pad + V::size(), A(0));  // the tail's vector load
  }
  // Scores kW keys at a time: one accumulator per key (the dot product's vectors in turn), their
  // lanes summed together (lane_sums); the last < kW keys one by one.
  void scores(int64_t b, int64_t hkv, int64_t kb, int64_t n_keys, int64_t cols, A* s_tile) const {
    const int64_t k0 = kb * kBlockK, D = sh.D;
    int64_t j = 0;
    for (; j + kW <= n_keys; j += kW) {
      const T* keys[kW];
      V dots[kW];
#pragma GCC unroll 16
      for (int64_t w = 0; w < kW; ++w) {
        keys[w] = kv_row<T>(a, a.k, b, hkv, k0 + j + w);
        dots[w] = V(A(0));
      }
      int64_t d = 0;
      for (; d + kW <= D; d += kW) {
        const V q = V::loadu(q_row + d);
#pragma GCC unroll 16
        for (int64_t w = 0; w < kW; ++w) dots[w] = at::vec::fmadd(q, load_acc(keys[w] + d), dots[w]);
      }
      if (d < D) {
        const V q = V::loadu(q_row + d);
#pragma GCC unroll 16
        for (int64_t w = 0; w < kW; ++w) dots[w] = at::vec::fmadd(q, load_acc(keys[w] + d, D - d), dots[w]);
      }
      lane_sums(dots).store(s_tile + j);
    }
    for (; j < n_keys; ++j) {
      const T* key = kv_row<T>(a, a.k, b, hkv, k0 + j);
      V s0(A(0)), s1(A(0));
      int64_t d = 0;
      for (; d + 2 * kW <= D; d += 2 * kW) {
        s0 = at::vec::fmadd(V::loadu(q_row + d), load_acc(key + d), s0);
        s1 = at::vec::fmadd(V::loadu(q_row + d + kW), load_acc(key + d + kW), s1);
      }
      for (; d + kW <= D; d += kW) s0 = at::vec::fmadd(V::loadu(q_row + d), load_acc(key + d), s0);
      if (d < D) s1 = at::vec::fmadd(V::loadu(q_row + d), load_acc(key + d, D - d), s1);
      s_tile[j] = reduce_add(s0 + s1);
    }
    std::fill(s_tile + n_keys, s_tile + cols, A(0));
  }
  void p_row(const A*, int64_t, int64_t) {}  // P is read from the score row itself
  // acc += P V over the block's seen keys, at most kPvVecs vectors of acc's columns at a time,
  // held in registers across the keys.
  void pv(int64_t b, int64_t hkv, int64_t kb, int64_t n_keys, int64_t, const A* s_tile, A* acc,
          bool accumulate) const {
    const int64_t k0 = kb * kBlockK;
    const int64_t j0 = std::max<int64_t>(0, sh.first_seen_key() - k0);
    const int64_t j1 = std::min(n_keys, sh.end_seen_key() - k0);
    if (!accumulate) std::fill(acc, acc + sh.Dv_pad, A(0));
    for (int64_t d0 = 0; d0 < sh.Dv; d0 += kPvVecs * kW) {
      const int64_t n_d = std::min(sh.Dv - d0, kPvVecs * kW);
      switch ((n_d + kW - 1) / kW) {
        case 1: pv_columns<1, 2>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 2: pv_columns<2, 2>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 3: pv_columns<3, 2>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 4: pv_columns<4, 2>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 5: pv_columns<5, 1>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 6: pv_columns<6, 1>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        case 7: pv_columns<7, 1>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
        default: pv_columns<8, 1>(b, hkv, k0, j0, j1, s_tile, d0, n_d, acc); break;
      }
    }
  }

 private:
  static constexpr int64_t kW = V::size();
  static constexpr int64_t kPvVecs = 8;
  // acc[d0, d0 + n_d) += sum_j p_j v_j[d0, d0 + n_d) for keys [j0, j1): NV vectors (the last
  // n_d - (NV - 1) kW columns wide) in registers, two sets of them at NV <= 4 (even and odd
  // keys) so that 8 FMA chains are in flight.
  template <int NV, int P>
  void pv_columns(int64_t b, int64_t hkv, int64_t k0, int64_t j0, int64_t j1, const A* p, int64_t d0,
                  int64_t n_d, A* acc) const {
    static_assert(P == 1 || P == 2, "one or two sets of accumulators");
    const int64_t last = n_d - (NV - 1) * kW;  // columns of the last vector, 1 .. kW
    V even[NV], odd[NV];
    for (int v = 0; v < NV; ++v) {
      even[v] = V::loadu(acc + d0 + v * kW);  // acc rows are Dv_pad (a multiple of kW) wide
      odd[v] = V(A(0));
    }
    int64_t j = j0;
    if constexpr (P == 2) {
      for (; j + 2 <= j1; j += 2) {
        add_value_row<NV>(even, kv_row<T>(a, a.v, b, hkv, k0 + j) + d0, p[j], last);
        add_value_row<NV>(odd, kv_row<T>(a, a.v, b, hkv, k0 + j + 1) + d0, p[j + 1], last);
      }
    }
    for (; j < j1; ++j) add_value_row<NV>(even, kv_row<T>(a, a.v, b, hkv, k0 + j) + d0, p[j], last);
    for (int v = 0; v < NV; ++v) (P == 2 ? even[v] + odd[v] : even[v]).store(acc + d0 + v * kW);
  }
  template <int NV>
  static inline __attribute__((always_inline)) void add_value_row(V (&sum)[NV], const T* value, A p,
                                                                   int64_t last) {
    const V p_v(p);
    for (int v = 0; v < NV - 1; ++v) sum[v] = at::vec::fmadd(load_acc(value + v * kW), p_v, sum[v]);
    const V x = last == kW ? load_acc(value + (NV - 1) * kW) : load_acc(value + (NV - 1) * kW, last);
    sum[NV - 1] = at::vec::fmadd(x, p_v, sum[NV - 1]);
  }
};

#ifdef FF_HAVE_BF16_GEMM
// A task's GEMMs on bf16 instructions (bf16 inputs; `kind` AMX or VDPBF16PS):
//   S^T (keys x R16) = K_block Q^T: A = the cache's key rows, 16 at a time, read in place where
//     a group is 16 keys of the block at one row stride with whole 32-value segments (D a
//     multiple of 32; a paged cache: inside one page), else copied zero padded into k_stage;
//     B = Q^T as pair words (R rows padded to R16 = a multiple of 16). Then 8 x 8 transposes
//     into the score tile's rows, which the row code reads as the fp32 path's.
//   acc (+)= P V with P rounded to bf16, or, in calls that write the output's rounding residual
//     (a backward follows), acc (+)= P_hi V + P_lo V: P's rows as hi + lo bf16 parts (p_row,
//     split_row_to_bf16: P to ~16 bits, as the fp32 path's P V nearly, and as the forward's
//     Bf16Gemms; with P rounded to bf16 alone, a converted bf16 BERT of 13 tokens -- decoded
//     here -- read its key bias's gradient (exactly 0) at 3.3x eager bf16's error), V's rows
//     interleaved in pairs from the cache (put_row_pairs_panels_of), keys past the block's end
//     and keys no query sees as zero rows (0 times a value no query may read must not reach
//     acc). The second GEMM reads V's pair words again from L1 / L2, but its tiles are 16 query
//     rows of which a GQA group uses a few: decoding without a gradient (no residual) skips it,
//     2-core Zen 4, attention_with_kvcache 1 token, 32/8 heads, D 128, bf16, medians of 7 x 50
//     calls, two runs each: cache 4096 1781-2059 -> 1275-1326 us, cache 1024 337-367 -> 255-265.
// Reads each K and V row once from the cache and writes V's pair words (its own size) to the
// thread's cache; the fp32 path converts both into fp32 panels (4 bytes written per value and
// read back). B=1 q=1 32/8 heads D=128 cache 4096 bf16 (fastformer-bench --op decode, 2-core
// AMX Xeon, one run): 0.78 ms against torch SDPA's 1.51; on the fp32 path 1.94-2.12 ms against
// SDPA's 1.37 in earlier runs.
struct DecodeBf16Gemms {
  using T = c10::BFloat16;
  using A = float;
  static constexpr int64_t kRowAlign = 16;
  const AttnArgs& a;
  const Shape<A>& sh;
  const Bf16Gemm kind;
  const int64_t R, R16;
  T* const q_rows;       // R16 x D_bf16, zero padded
  uint32_t* const q_pairs;  // Q^T as pair words: one 16-column panel per 16 rows
  A* const s_t;          // S^T: kBlockK x R16
  T* const k_stage;      // a group of 16 keys the tile loads cannot read in place
  uint32_t* const v_pairs;  // the block's V rows interleaved in pairs: Dv_bf16 / 16 panels
  T* const p_hi;         // R16 x kBlockK each: P (split: p_hi + p_lo), zero rows past R
  T* const p_lo;         // null unless split
  const bool split;      // calls that write the output's rounding residual (a backward follows)

  DecodeBf16Gemms(const AttnArgs& args, const Shape<A>& shape, int64_t rows, Bf16Gemm gemm_kind)
      : a(args), sh(shape), kind(gemm_kind), R(rows), R16(round_up_to(rows, 16)),
        q_rows(thread_scratch<T, Scratch::kDecQBf16>(R16 * shape.D_bf16)),
        q_pairs(thread_scratch<uint32_t, Scratch::kDecQPairs>(R16 * shape.D_bf16 / 2)),
        s_t(thread_scratch<A, Scratch::kDecScoresT>(kBlockK * R16)),
        k_stage(thread_scratch<T, Scratch::kDecKStage>(16 * shape.D_bf16)),
        v_pairs(thread_scratch<uint32_t, Scratch::kDecVPairs>(kBlockK * shape.Dv_bf16 / 2)),
        p_hi(thread_scratch<T, Scratch::kDecPHi>(R16 * kBlockK)),
        p_lo(args.out_residual.ptr != nullptr ? thread_scratch<T, Scratch::kDecPLo>(R16 * kBlockK) : nullptr),
        split(p_lo != nullptr) {
    TORCH_INTERNAL_ASSERT(sh.Dv_bf16 == sh.Dv_pad, "bf16 P V tiles write acc rows Dv_pad wide");
  }

  void load_q(int64_t b, int64_t hkv) {
    for (int64_t r = 0; r < R16; ++r) {
      T* q_row = q_rows + r * sh.D_bf16;
      if (r < R) put_bf16_row(row_ptr<T>(a.q, b, hkv * sh.G + r / a.Lq, r % a.Lq), sh.D, sh.D_bf16, q_row);
      else std::fill(q_row, q_row + sh.D_bf16, T(0.0f));
    }
    put_rows_pair_panels(q_rows, sh.D_bf16, R16, sh.D_bf16, q_pairs);
    std::fill(p_hi + R * kBlockK, p_hi + R16 * kBlockK, T(0.0f));
    if (split) std::fill(p_lo + R * kBlockK, p_lo + R16 * kBlockK, T(0.0f));
  }

  void scores(int64_t b, int64_t hkv, int64_t kb, int64_t n_keys, int64_t cols, A* s_tile) const {
    const int64_t k0 = kb * kBlockK, lda = a.k.s[2];
    const auto key = [&](int64_t j) { return kv_row<T>(a, a.k, b, hkv, k0 + j); };
    // Groups read in place: whole 32-value segments, 16 keys of the block, inside one page
    // (groups start at multiples of 16, as pages of a multiple of 16 keys do, unless a left
    // padding moves the row's start off them).
    const int64_t start = a.k_starts ? a.k_starts[b] : 0;
    const bool segments_whole =
        sh.D == sh.D_bf16 && (!a.block_table || (a.block_size % 16 == 0 && start % 16 == 0));
    const auto in_place = [&](int64_t j) { return segments_whole && j + 16 <= n_keys; };
    for (int64_t j = 0; j < cols;) {
      if (in_place(j)) {  // the run of groups at one stride: one GEMM
        int64_t end = j + 16;
        while (end < cols && in_place(end) && key(end) == key(j) + (end - j) * lda) end += 16;
        bf16_tile_gemm(kind, end - j, R16, sh.D_bf16, key(j), lda, q_pairs, s_t + j * R16, R16, false, Band{});
        j = end;
        continue;
      }
      for (int64_t c = 0; c < 16; ++c) {
        T* row = k_stage + c * sh.D_bf16;
        if (j + c < n_keys) put_bf16_row(key(j + c), sh.D, sh.D_bf16, row);
        else std::fill(row, row + sh.D_bf16, T(0.0f));
      }
      bf16_tile_gemm(kind, 16, R16, sh.D_bf16, k_stage, sh.D_bf16, q_pairs, s_t + j * R16, R16, false, Band{});
      j += 16;
    }
    for (int64_t j = 0; j < cols; j += 8)
      for (int64_t r0 = 0; r0 < R16; r0 += 8)
        transpose_8x8<A>(s_t + j * R16 + r0, R16, s_tile + r0 * kScoreLd + j, kScoreLd);
  }

  void p_row(const A* p, int64_t r, int64_t cols) {
    if (split) split_row_to_bf16(p, cols, p_hi + r * kBlockK, p_lo + r * kBlockK);
    else round_row_to_bf16(p, cols, p_hi + r * kBlockK);
  }

  void pv(int64_t b, int64_t hkv, int64_t kb, int64_t n_keys, int64_t cols, const A*, A* acc, bool accumulate) const {
    const int64_t k0 = kb * kBlockK;
    const int64_t seen_begin = sh.first_seen_key() - k0, seen_end = std::min(n_keys, sh.end_seen_key() - k0);
    const auto value_row = [&](int64_t j) -> const T* {
      return j >= seen_begin && j < seen_end ? kv_row<T>(a, a.v, b, hkv, k0 + j) : nullptr;
    };
    put_row_pairs_panels_of(value_row, cols, sh.Dv, sh.Dv_bf16, v_pairs);
    bf16_tile_gemm(kind, R, sh.Dv_bf16, cols, p_hi, kBlockK, v_pairs, acc, sh.Dv_pad, accumulate, Band{});
    if (split) bf16_tile_gemm(kind, R, sh.Dv_bf16, cols, p_lo, kBlockK, v_pairs, acc, sh.Dv_pad, true, Band{});
  }
};
#endif
template <typename T, class Gemms>
void attention_decode_typed(const AttnArgs& a, Bf16Gemm kind) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const Shape<A> full(a);
  const int64_t G = full.G, Lq = a.Lq, R = G * Lq;  // a task's rows: (g, i) at g * Lq + i
  const int64_t R_pad = round_up_to(R, Gemms::kRowAlign);
  const int64_t n_split = a.B * a.Hkv >= kTasksWithoutSplits
                              ? 1
                              : std::max<int64_t>((full.n_kb + kBlocksPerSplit - 1) / kBlocksPerSplit, 1);
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
    store_out_row<T>(a, b, h, i, acc, inv);
    static_cast<A*>(a.lse)[b * a.lse_s[0] + h * a.lse_s[1] + i] = softmax_lse_log2(m, l);
  };

  // The one-row path is bound by reading the cache, not by its flops: its tasks go to both
  // threads from a quarter of the flops the GEMM paths wait for (fp32 (1, 16, 1, 64) against
  // 280 keys, 2-core Xeon: 93 us on one thread, 44 on two; torch SDPA 40).
  const double flops = 2.0 * a.B * a.H * Lq * a.Lk * (a.D + a.Dv) * (Gemms::kRowAlign == 1 ? 4.0 : 1.0);
  parallel_tasks(a.B * a.Hkv * n_split, flops, [&](int64_t task) {
    const int64_t split = task % n_split, bhkv = task / n_split;
    const int64_t b = bhkv / a.Hkv, hkv = bhkv % a.Hkv;
    AttnArgs ab = a;  // this row's key length (a KV cache: the band's d follows it)
    if (a.k_lens) ab.Lk = a.k_lens[b] - (a.k_starts ? a.k_starts[b] : 0);
    const Shape<A> sh(ab);
    const int64_t kb_lo = sh.kb_begin(0), kb_hi = sh.kb_end(Lq);
    const int64_t per_split = (std::max<int64_t>(kb_hi - kb_lo, 0) + n_split - 1) / n_split;
    const int64_t kb0 = kb_lo + split * per_split, kb1 = std::min(kb_hi, kb0 + per_split);

    const AmxTiles tiles(kind);
    Gemms gemms(ab, sh, R, kind);
    A* const s_tile = thread_scratch<A, Scratch::kDecScores>((R_pad + kRowSlack) * kScoreLd);
    A* const acc = thread_scratch<A, Scratch::kDecAcc>(R_pad * Dv_pad);
    A* const bias = thread_scratch<A, Scratch::kDecBias>(sh.Bk_pad + V::size());
    A* const row_max = thread_scratch<A, Scratch::kDecRowMax>(R);
    A* const row_sum = thread_scratch<A, Scratch::kDecRowSum>(R);
    gemms.load_q(b, hkv);
    std::fill(row_max, row_max + R, kNegInf<A>);
    std::fill(row_sum, row_sum + R, A(0));
    if (kb0 >= kb1) std::fill(acc, acc + R * Dv_pad, A(0));
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t k0 = kb * kBlockK, n_keys = sh.block_keys(kb), cols = sh.block_cols(n_keys);
      gemms.scores(b, hkv, kb, n_keys, cols, s_tile);
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
        gemms.p_row(s, r, cols);
        if (alpha != A(1) && kb > kb0) {
          A* acc_r = acc + r * Dv_pad;
          const V alpha_v(alpha);
          for (int64_t d = 0; d < Dv_pad; d += V::size()) (V::loadu(acc_r + d) * alpha_v).store(acc_r + d);
        }
      }
      gemms.pv(b, hkv, kb, n_keys, cols, s_tile, acc, kb > kb0);
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
  }, /*equal_tasks=*/n_split == 1);
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
  dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t G = args.Hkv > 0 ? args.H / args.Hkv : 1;
    if (G * args.Lq == 1) return attention_decode_typed<T, DecodeRowGemms<T>>(args, Bf16Gemm::kFp32);
#ifdef FF_HAVE_BF16_GEMM
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const Bf16Gemm kind = bf16_gemm();
      if (kind != Bf16Gemm::kFp32) return attention_decode_typed<T, DecodeBf16Gemms>(args, kind);
    }
#endif
    attention_decode_typed<T, DecodeFp32Gemms<T>>(args, Bf16Gemm::kFp32);
  });
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
