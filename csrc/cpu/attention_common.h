// Pieces shared by the CPU flash attention forward (attention_fwd.cpp) and backward
// (attention_bwd.cpp): tile sizes, the call's Shape, K/V packing and the task scheduler (the
// score rows: attention_scores.h; packed and KV-cache calls split per sequence:
// attention_sequences.h). Semantics: reference/attention.py.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/online_softmax.h"
#include "common/philox.h"
#include "cpu/bf16_gemm.h"
#include "cpu/cpu_kernels.h"
#include "cpu/gemm.h"
#include "cpu/philox_vec.h"
#include "cpu/vec_math.h"
#include "cpu/vec_utils.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace attn {

// Query rows and keys per tile: whole micro-tiles both ways (144 = 24 x 6 = 12 x 12 rows for
// MR = 6 on AVX2 and 12 on AVX-512; 192 = 32 x 6 = 16 x 12 rows, and 12 x 16 = 6 x 32 columns).
// Tile GEMMs take queries as rows (S, dP, O += P V, dQ += dS K) or keys (dV += P^T dO,
// dK += dS^T Q). The backward's dV and dK GEMMs run over the tile's queries: every micro-tile
// of them loads and stores its 6 x 16 accumulator once per kBlockQ queries, and 144 halves
// that overhead against 72 (their S / P tiles, 144 x 192 fp32 = 108 KB, still come from L2).
// Measured side by side (the builds loaded in one process under distinct module names, called
// alternately, medians of 5): forward + backward (1, 16, 4096, 128) 1.01x (72 -> 144, with
// the micro-kernel unrolled, gemm.h); 96, 120 and 216 rows, or 96 / 256 keys, no better.
constexpr int64_t kBlockQ = 144;
constexpr int64_t kBlockK = 192;
// Row stride of the score tiles (S, P, dS): the widest block plus slack columns (P^T reads in
// the backward), a compile-time constant so that the GEMMs reading them as A operands (O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q) address their MR rows as constant offsets (gemm.h).
constexpr int64_t kScoreLd = kBlockK + kRowSlack;
// Columns the relative-position bias vector and its gradient are padded with (bindings), for
// the vector reads of a block's padding columns (< one NR of them, plus one vector).
constexpr int64_t kRelSlack = 64;

// The forward's choice of tasks (attention_fwd.cpp): whole heads that pack their own K/V as
// their query blocks reach it when the key blocks one query block sees (a window's band, else
// the head's) take at most kPackInTaskBytes packed and there are at least kHeadTasksPerThread
// heads per thread; else query blocks sharing K/V packed up front.
constexpr int64_t kPackInTaskBytes = 1 << 20;
constexpr int64_t kHeadTasksPerThread = 4;

template <typename A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// Bool masks are bytes 0 or 1: 8 of them read as one word, all true iff it is kTrueBools8.
constexpr uint64_t kTrueBools8 = 0x0101010101010101ull;
inline uint64_t bools8(const bool* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

// Sizes derived once per call. Padded widths are multiples of the micro-tile's NR, padded
// heights leave kRowSlack rows of zeros for the micro-kernel's full-tile reads.
//
// The band: key j is visible to query i iff i + lo_shift <= j (when has_lo) and
// j <= i + hi_shift (when has_hi). Causality is the upper edge at the diagonal d (d = Lk - Lq
// for bottom-right alignment, else 0), the window's right and left sizes move the edges
// (hi_shift = d + right, lo_shift = d - left). Key blocks wholly outside the band are never
// visited; tiles an edge cuts are "cut": the upper edge lets the GEMMs skip the micro-tiles
// wholly above it (Band in gemm.h), the lower edge is applied by score_row.
template <typename A>
struct Shape {
  int64_t B, H, Hkv, G, Lq, Lk, D, Dv;
  int64_t D_pad, Dv_pad, Bk_pad, n_kb, n_qb;
  int64_t D_bf16, Dv_bf16;  // D, Dv padded to whole 32-value tile rows for the bf16 GEMMs (bf16_gemm.h)
  int64_t diag;           // d
  bool has_hi, has_lo;
  int64_t hi_shift, lo_shift;
  // Masks or key padding: a bias row per score row (bias_row). ALiBi and the relative bias
  // are added inline (InlineBias). Either way every row goes through score_row.
  bool bias_row, alibi, rel;
  bool dropout;
  A cap_in = 0, cap_out = 0;  // softcap: s_log2 = cap_out * tanh(cap_in * S), S = Q K^T
  ScaledTanh<A> cap;          // cap_out * tanh(cap_in * S) + addend (vec_math.h)
  // ALiBi's and the relative bias's terms over j - i when a TermsTable holds them (null:
  // InlineBias computes them): (b, h)'s vector at terms + b * terms_bs + h * terms_ld.
  const A* terms = nullptr;
  int64_t terms_ld = 0, terms_bs = 0;
  const A* terms_max = nullptr;  // the largest entry of (b, h)'s vector at [b * H + h] (terms_bs
                                 // != 0) or [h]
  A terms_bound(int64_t b, int64_t h) const { return terms_max[(terms_bs != 0 ? b * H : 0) + h]; }

  explicit Shape(const AttnArgs& a) {
    constexpr int64_t NR = MicroShape<A>::kNR;
    B = a.B; H = a.H; Hkv = a.Hkv; G = a.H / a.Hkv; Lq = a.Lq; Lk = a.Lk; D = a.D; Dv = a.Dv;
    D_pad = round_up_to(D, NR);
    Dv_pad = round_up_to(Dv, NR);
    D_bf16 = bf16_padded_k(D);
    Dv_bf16 = bf16_padded_k(Dv);
    Bk_pad = round_up_to(std::clamp<int64_t>(Lk, 1, kBlockK), NR);  // the widest block's columns
    n_kb = (Lk + kBlockK - 1) / kBlockK;
    n_qb = (Lq + kBlockQ - 1) / kBlockQ;
    diag = a.causal == 2 ? Lk - Lq : 0;
    has_hi = a.causal != 0 || a.window_right >= 0;
    hi_shift = diag + (a.causal != 0 ? 0 : a.window_right);
    has_lo = a.window_left >= 0;
    lo_shift = diag - a.window_left;
    bias_row = a.key_padding_mask || a.attn_mask.ptr;
    alibi = a.alibi_slopes != nullptr;
    rel = a.rel_bias != nullptr;
    dropout = a.dropout_p > 0;
    if (a.softcap > 0) {
      cap_in = static_cast<A>(a.scale / a.softcap);
      cap_out = static_cast<A>(a.softcap * kLog2e);
      cap = ScaledTanh<A>(cap_in, cap_out, /*short_poly=*/a.dtype == DType::bf16 || a.dtype == DType::f16);
    }
  }

  // Key blocks [kb_begin, kb_end) that query rows [q0, q1) can see.
  int64_t kb_begin(int64_t q0) const {
    if (!has_lo) return 0;
    const int64_t first_key = q0 + lo_shift;  // the first query's first visible key
    return first_key <= 0 ? 0 : std::min(n_kb, first_key / kBlockK);
  }
  int64_t kb_end(int64_t q1) const {
    if (!has_hi) return n_kb;
    const int64_t last_key = q1 - 1 + hi_shift;  // the last query's last visible key
    if (last_key < 0) return 0;
    return std::min(n_kb, last_key / kBlockK + 1);
  }
  // Query rows [q_begin, q_end) that can see some key of block kb.
  int64_t q_begin(int64_t kb) const {
    return has_hi ? std::clamp<int64_t>(kb * kBlockK - hi_shift, 0, Lq) : 0;
  }
  int64_t q_end(int64_t kb) const {
    return has_lo ? std::clamp<int64_t>(kb * kBlockK + block_keys(kb) - lo_shift, 0, Lq) : Lq;
  }
  // Whether some (query, key) pair of the tile is cut by the upper edge (the causal diagonal),
  // or (query rows [q0, q1)) by the lower one, or by either.
  bool diagonal(int64_t q0, int64_t kb) const { return has_hi && (kb + 1) * kBlockK - 1 > q0 + hi_shift; }
  bool lower_cut(int64_t q1, int64_t kb) const { return has_lo && kb * kBlockK < q1 - 1 + lo_shift; }
  bool cut(int64_t q0, int64_t q1, int64_t kb) const { return diagonal(q0, kb) || lower_cut(q1, kb); }
  // Keys of block kb, and the score columns its tiles compute: rounded up to the micro-tile's
  // NR only, so a short last block (Lk = 2048 = 10 * 192 + 128) costs its own keys, not a
  // whole kBlockK. Columns in [n_keys, cols) are padding keys (zero K/V rows, P = 0).
  int64_t block_keys(int64_t kb) const { return std::min(kBlockK, Lk - kb * kBlockK); }
  // Keys [first_seen_key, end_seen_key) are the ones some query's band reaches. The bf16
  // pair-word layouts hold zeros for the others: a pair can join a key its row cannot see (P,
  // dS 0) to one it can, and 0 times a key or value no query may read (NaN, say) must not
  // reach the sums.
  int64_t first_seen_key() const { return has_lo ? std::clamp<int64_t>(lo_shift, 0, Lk) : 0; }
  int64_t end_seen_key() const { return has_hi ? std::clamp<int64_t>(Lq + hi_shift, 0, Lk) : Lk; }
  static int64_t block_cols(int64_t n_keys) { return round_up_to(n_keys, MicroShape<A>::kNR); }
  // Whether every row of tile (q0 .. q1, kb) has the same bias row: the key padding is its only
  // mask and no edge cuts it (bias_row is then built once per tile: per row, it took 40% of a
  // padded bf16 (4, 12, 256, 64) forward).
  bool shared_bias(const AttnArgs& a, int64_t q0, int64_t q1, int64_t kb) const {
    return bias_row && !a.attn_mask.ptr && !cut(q0, q1, kb);
  }
  // Whether no mask, bias, softcap, edge or padding column touches tile (q0 .. q1, kb) and the
  // scale is positive: both passes then compute P straight from the GEMM's S with one FMA
  // (exp2_row's mul), the others through score_row. The forward and the backward must agree on
  // this for the backward's P to be the forward's. mask_free: the bool mask and the key padding
  // attend every pair of this tile (MaskTiles::kFull), so the bias row would be all zeros.
  bool unmasked(int64_t q0, int64_t q1, int64_t kb, A score_mul, bool mask_free) const {
    const int64_t n_keys = block_keys(kb);
    return !cut(q0, q1, kb) && n_keys == block_cols(n_keys) && (!bias_row || mask_free) && !alibi && !rel &&
           cap_out == A(0) && score_mul > A(0);
  }
  // Whether a tile's softcapped P is 2^(cap(S) - shift) with one rounding of the difference
  // (the forward's on-the-fly exp pass, the backward's p_ds_row, the same tiles in both): a
  // softcap and no other option that changes a score, an uncut tile without padding columns;
  // else the capped score is rounded on its own and the shift subtracted after (score_row,
  // exp2_row).
  bool cap_fused(bool cut, int64_t n_keys, int64_t cols) const {
    return cap_out != A(0) && cap_in > A(0) && !alibi && !rel && !bias_row && !dropout && !cut && n_keys == cols;
  }
  // The visible keys [lo_begin, hi_end) of [k0, k0 + n_keys) for query qi (local indices).
  int64_t hi_end(int64_t qi, int64_t k0, int64_t n_keys) const {
    return has_hi ? std::clamp<int64_t>(qi + hi_shift - k0 + 1, 0, n_keys) : n_keys;
  }
  int64_t lo_begin(int64_t qi, int64_t k0, int64_t n_keys) const {
    return has_lo ? std::clamp<int64_t>(qi + lo_shift - k0, 0, n_keys) : 0;
  }
  // The tile's band for tile_gemm (query rows [q0, q1) of key block kb): local key j is
  // allowed for local query i iff i + lo_diag <= j <= i + diag, the edges that cut the tile.
  // No band (full tile) for a tile no edge cuts.
  Band band(int64_t q0, int64_t q1, int64_t kb, Band::Kind kind) const {
    const bool upper = diagonal(q0, kb), lower = lower_cut(q1, kb);
    if (!upper && !lower) return {};
    Band band;
    band.kind = kind;
    if (upper) band.diag = q0 + hi_shift - kb * kBlockK;
    if (lower) band.lo_diag = q0 + lo_shift - kb * kBlockK;
    return band;
  }
};

// Element (b, h, l, 0) of a view.
template <typename T>
inline const T* row_ptr(const View4& v, int64_t b, int64_t h, int64_t l) {
  return static_cast<const T*>(v.ptr) + b * v.s[0] + h * v.s[1] + l * v.s[2];
}

// Row (b, h, i) of the output from its fp32 accumulator: acc * inv rounded to T. bf16 / fp16
// calls with a residual view also write what the rounding lost, (acc * inv - out) rounded to T,
// so that the backward's delta_i = dO_i . O_i reads the fp32 output (out + residual):
// dS = P (dP - delta) then sums to ~0 over each row, as it does in exact arithmetic. With the
// rounded output alone (FlashAttention's and torch SDPA's delta) the rounding error of O_i
// enters every dS_ij of the row; gradients that cancel exactly (a key projection's bias) were
// ~10x worse than with the residual (TAPAS layer, (2, 4, 23, 16), 20 draws: median 0.023 vs 0.0024).
template <typename T, typename A>
inline void store_out_row(const AttnArgs& a, int64_t b, int64_t h, int64_t i, const A* acc, Vectorized<A> inv) {
  using V = Vectorized<A>;
  T* const out_i = const_cast<T*>(row_ptr<T>(a.out, b, h, i));
  T* const res_i = a.out_residual.ptr ? const_cast<T*>(row_ptr<T>(a.out_residual, b, h, i)) : nullptr;
  for (int64_t d = 0; d < a.Dv; d += V::size()) {
    const int64_t n = std::min<int64_t>(V::size(), a.Dv - d);
    const V y = V::loadu(acc + d) * inv;
    store_acc(out_i + d, y, n);
    if constexpr (is_reduced_v<T>) {
      if (res_i) store_acc(res_i + d, y - (n == V::size() ? load_acc(out_i + d) : load_acc(out_i + d, n)), n);
    }
  }
}

// Row j of kv head (b, h) of the keys or values, counted from the row's first key (k_starts:
// left padding): through the block table of a paged cache (AttnArgs::block_table), else the
// view's row.
template <typename T>
inline const T* kv_row(const AttnArgs& a, const View4& v, int64_t b, int64_t h, int64_t j) {
  if (a.k_starts) j += a.k_starts[b];
  if (!a.block_table) return row_ptr<T>(v, b, h, j);
  const int64_t block = a.block_table[b * a.bt_stride + j / a.block_size];
  return static_cast<const T*>(v.ptr) + block * v.s[0] + h * v.s[1] + (j % a.block_size) * v.s[2];
}

// Converts n elements of a row into the accumulation type, zero-filling [n, n_pad).
template <typename T, typename A>
inline void load_row(const T* src, int64_t n, int64_t n_pad, A* dst) {
  using V = Vectorized<A>;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) load_acc(src + j).store(dst + j);
  if (j < n) load_acc(src + j, n - j).store(dst + j);
  for (j = n; j < n_pad; ++j) dst[j] = A(0);
}

// Packed operands, all fp32 (fp64 for fp64), zero padded, panel-major for the micro-kernel
// (see tile_gemm in gemm.h), per (batch, kv head) and key block (a block's panels contiguous):
//   kt: K^T blocks     [blocks][Bk_pad/NR][D][NR]     B of S = Q K^T          (forward, backward)
//   vt: V^T blocks     [blocks][Bk_pad/NR][Dv][NR]    B of dP = dO V^T        (backward)
//   vp: V by columns   [blocks][Dv_pad/NR][Bk_pad][NR] B of O += P V          (forward)
//   kp: K by columns   [blocks][D_pad/NR][Bk_pad][NR]  B of dQ += dS K        (backward)
// With bf16 inputs on bf16 instructions (pairs = true) B operands are bf16 pair words instead (bf16_gemm.h;
// the inputs' own bf16 values, no rounding):
//   kw: K^T blocks     [blocks][Bk_pad/16][D_bf16/2][16]   B of S = Q K^T        (for kt)
//   vw: V^T blocks     [blocks][Bk_pad/16][Dv_bf16/2][16]  B of dP = dO V^T      (for vt)
//   vpw: V blocks      [blocks][Dv_bf16/16][Bk_pad/2][16]  B of O += P V         (for vp)
//   kpw: K blocks      [blocks][D_bf16/16][Bk_pad/2][16]   B of dQ += dS K       (for kp)
// The forward packs every (batch, kv head) up front, in parallel (its tasks are query blocks
// of a head and share the head's packed blocks); each backward task packs the key blocks it
// owns into its thread's buffers (heads = 1), so they are written to and read back from cache,
// not memory. Null pointers skip a layout.
template <typename A>
struct Packed {
  A *kt = nullptr, *vt = nullptr, *vp = nullptr, *kp = nullptr;
  A* k_norm2 = nullptr;  // forward: per block, the largest |k_j|^2 of its keys (the score bound)
  uint32_t *kw = nullptr, *vw = nullptr, *vpw = nullptr, *kpw = nullptr;
  int64_t kt_block_size = 0, vt_block_size = 0, vp_block_size = 0, kp_block_size = 0;
  int64_t kw_block_size = 0, vw_block_size = 0, vpw_block_size = 0, kpw_block_size = 0;
  int64_t blocks = 0;  // key blocks per head

  Packed(const Shape<A>& sh, int64_t heads, int64_t blocks_per_head, bool backward, bool pairs)
      : blocks(blocks_per_head) {
    if (pairs) {
      kw_block_size = sh.Bk_pad * sh.D_bf16 / 2;
      kw = thread_scratch<uint32_t, Scratch::kPackKw>(heads * blocks * kw_block_size);
    } else {
      kt_block_size = sh.Bk_pad * sh.D;
      kt = thread_scratch<A, Scratch::kPackKt>(heads * blocks * kt_block_size);
    }
    if (!backward) k_norm2 = thread_scratch<A, Scratch::kPackKNorm>(heads * blocks);
    if (backward && pairs) {
      vw_block_size = sh.Bk_pad * sh.Dv_bf16 / 2;
      vw = thread_scratch<uint32_t, Scratch::kPackVw>(heads * blocks * vw_block_size);
      kpw_block_size = sh.Bk_pad * sh.D_bf16 / 2;
      kpw = thread_scratch<uint32_t, Scratch::kPackKpw>(heads * blocks * kpw_block_size);
    } else if (backward) {
      kp_block_size = sh.Bk_pad * sh.D_pad;
      kp = thread_scratch<A, Scratch::kPackKp>(heads * blocks * kp_block_size);
      vt_block_size = sh.Bk_pad * sh.Dv;
      vt = thread_scratch<A, Scratch::kPackVt>(heads * blocks * vt_block_size);
    } else if (pairs) {
      vpw_block_size = sh.Bk_pad * sh.Dv_bf16 / 2;
      vpw = thread_scratch<uint32_t, Scratch::kPackVpw>(heads * blocks * vpw_block_size);
    } else {
      vp_block_size = sh.Bk_pad * sh.Dv_pad;
      vp = thread_scratch<A, Scratch::kPackVp>(heads * blocks * vp_block_size);
    }
  }
  // B operands of block `blk` of head `bh` (vp, kp: panel stride Bk_pad * NR): read-only
  // through a const Packed (the GEMMs), writable through a mutable one (pack_kv_block).
  const A* kt_block(int64_t bh, int64_t blk) const { return block(kt, kt_block_size, bh, blk); }
  const A* vt_block(int64_t bh, int64_t blk) const { return block(vt, vt_block_size, bh, blk); }
  const A* vp_block(int64_t bh, int64_t blk) const { return block(vp, vp_block_size, bh, blk); }
  const A* kp_block(int64_t bh, int64_t blk) const { return block(kp, kp_block_size, bh, blk); }
  A* kt_block(int64_t bh, int64_t blk) { return block(kt, kt_block_size, bh, blk); }
  A* vt_block(int64_t bh, int64_t blk) { return block(vt, vt_block_size, bh, blk); }
  A* vp_block(int64_t bh, int64_t blk) { return block(vp, vp_block_size, bh, blk); }
  A* kp_block(int64_t bh, int64_t blk) { return block(kp, kp_block_size, bh, blk); }
  A key_norm2(int64_t bh, int64_t blk) const { return k_norm2[bh * blocks + blk]; }
  const uint32_t* kw_block(int64_t bh, int64_t blk) const { return block(kw, kw_block_size, bh, blk); }
  const uint32_t* vw_block(int64_t bh, int64_t blk) const { return block(vw, vw_block_size, bh, blk); }
  uint32_t* kw_block(int64_t bh, int64_t blk) { return block(kw, kw_block_size, bh, blk); }
  uint32_t* vw_block(int64_t bh, int64_t blk) { return block(vw, vw_block_size, bh, blk); }
  const uint32_t* vpw_block(int64_t bh, int64_t blk) const { return block(vpw, vpw_block_size, bh, blk); }
  uint32_t* vpw_block(int64_t bh, int64_t blk) { return block(vpw, vpw_block_size, bh, blk); }
  const uint32_t* kpw_block(int64_t bh, int64_t blk) const { return block(kpw, kpw_block_size, bh, blk); }
  uint32_t* kpw_block(int64_t bh, int64_t blk) { return block(kpw, kpw_block_size, bh, blk); }

 private:
  template <typename E>
  E* block(E* base, int64_t block_size, int64_t bh, int64_t blk) const { return base + (bh * blocks + blk) * block_size; }
};

// C (+)= A B of bf16 operands on the call's bf16 instructions (bf16_gemm.h) into fp32 C; only
// ever called with a kind other than kFp32, which implies T = bf16 and A = float.
template <typename A>
inline void tile_gemm_bf16(Bf16Gemm kind, int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t lda,
                           const uint32_t* b, A* c, int64_t ldc, bool accumulate, Band band) {
  if constexpr (std::is_same_v<A, float>) bf16_tile_gemm(kind, M, N, K, a, lda, b, c, ldc, accumulate, band);
  else TORCH_INTERNAL_ASSERT(false, "bf16 GEMM with a non-fp32 tile");
}

// n fp32 values (a multiple of the vector width) rounded to bf16 (nearest even).
template <typename A>
inline void round_row_to_bf16(const A* src, int64_t n, c10::BFloat16* dst) {
#ifdef FF_NATIVE_16BIT_CONVERT
  if constexpr (std::is_same_v<A, float>) {
    for (int64_t j = 0; j < n; j += Vectorized<float>::size())
      storeu_packed(dst + j, pack16<c10::BFloat16>(Vectorized<float>::loadu(src + j)));
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] = c10::BFloat16(static_cast<float>(src[j]));
}

// n fp32 values (a multiple of the vector width) as hi + lo, both bf16: hi = round(x), lo =
// round(x - hi) (x - hi is exact in fp32), x to ~16 significant bits instead of 8.
template <typename A>
inline void split_row_to_bf16(const A* src, int64_t n, c10::BFloat16* hi, c10::BFloat16* lo) {
#ifdef FF_NATIVE_16BIT_CONVERT
  if constexpr (std::is_same_v<A, float>) {
    using V = Vectorized<float>;
    for (int64_t j = 0; j < n; j += V::size()) {
      const V x = V::loadu(src + j);
      const auto x_hi = pack16<c10::BFloat16>(x);
      storeu_packed(hi + j, x_hi);
      storeu_packed(lo + j, pack16<c10::BFloat16>(x - unpack16<c10::BFloat16>(x_hi)));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float x = static_cast<float>(src[j]);
    hi[j] = c10::BFloat16(x);
    lo[j] = c10::BFloat16(x - static_cast<float>(hi[j]));
  }
}

// Rows row0 + [0, n_rows) of head (b, h) of bf16 view v, n values each, as rows n_bf16 wide
// (zero padded) in dst: those in [valid_begin, valid_end) copied, the others zeros: the bf16
// GEMMs' staging.
inline void stage_bf16_rows(const View4& v, int64_t b, int64_t h, int64_t row0, int64_t valid_begin,
                            int64_t valid_end, int64_t n_rows, int64_t n, int64_t n_bf16, c10::BFloat16* dst) {
  for (int64_t j = 0; j < n_rows; ++j) {
    c10::BFloat16* row = dst + j * n_bf16;
    if (j >= valid_begin && j < valid_end) put_bf16_row(row_ptr<c10::BFloat16>(v, b, h, row0 + j), n, n_bf16, row);
    else std::fill(row, row + n_bf16, c10::BFloat16(0.0f));
  }
}

// Writes row `key` (n values, zero padded to n_pad) as element (key, c) of a panel-major
// [n_pad/NR][rows][NR] matrix.
template <typename A>
inline void put_row_panels(A* dst, int64_t rows, int64_t key, const A* row, int64_t n_pad) {
  using V = Vectorized<A>;
  constexpr int64_t NR = MicroShape<A>::kNR;
  for (int64_t c = 0; c < n_pad; c += NR) {
    A* d = dst + (c / NR) * rows * NR + key * NR;
    for (int64_t v = 0; v < NR; v += V::size()) V::loadu(row + c + v).store(d + v);  // no memmove call
  }
}

// A operands reused by many tiles (Q, dO: every key block of a head reads them) are packed in
// MR-row panels, each panel K x MR contiguous: element (r, k) at (r / MR) * K * MR + k * MR + r % MR.
// The micro-kernel's MR broadcasts of one k are then one 24-byte read and a tile GEMM streams
// the operand sequentially (row-major, they were MR streams 256-512 bytes apart). tile_gemm
// reads it with a_row = 1, a_col = MR, a_panel = K * MR. Query blocks are packed separately,
// kQBlockRows rows each (kBlockQ rounded up to MR, the padding rows zero), a panel at a time
// from MR staged rows (put_mr_panel).
template <typename A>
constexpr int64_t kQBlockRows = (kBlockQ + MicroShape<A>::kMR - 1) / MicroShape<A>::kMR * MicroShape<A>::kMR;

// One MR-row panel from MR staged rows (row r at rows + r * ld, K values each; the caller zeroes
// rows past the operand's end): dst[k * MR + r] = rows[r * ld + k]. fp32 at the AVX2 / AVX-512
// levels: 4 rows x 8 columns at a time, 8 in-register shuffles and 8 16-byte stores (8-byte for
// the last 2 rows when MR = 6) instead of 32 scalar stores. Scalar otherwise.
template <typename A>
inline void put_mr_panel(const A* rows, int64_t ld, int64_t K, A* dst) {
  constexpr int64_t MR = MicroShape<A>::kMR;
  int64_t k0 = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float> && MR % 2 == 0) {
    for (; k0 + 8 <= K; k0 += 8) {
      for (int64_t r0 = 0; r0 < MR; r0 += 4) {
        const int64_t n_rows = std::min<int64_t>(4, MR - r0);  // 4, or 2 (MR = 6)
        __m256 r[4];
        for (int64_t j = 0; j < 4; ++j)
          r[j] = j < n_rows ? _mm256_loadu_ps(rows + (r0 + j) * ld + k0) : _mm256_setzero_ps();
        __m256 cols[4];  // rows r0 .. r0 + 3 of columns k0 + c (low half) and k0 + c + 4 (high)
        transpose_4x8_halves(r, cols);
        A* d = dst + k0 * MR + r0;
        for (int64_t c = 0; c < 4; ++c) {
          const __m128 lo = _mm256_castps256_ps128(cols[c]), hi = _mm256_extractf128_ps(cols[c], 1);
          if (n_rows == 4) {
            _mm_storeu_ps(d + c * MR, lo);
            _mm_storeu_ps(d + (c + 4) * MR, hi);
          } else {
            _mm_storel_pi(reinterpret_cast<__m64*>(d + c * MR), lo);
            _mm_storel_pi(reinterpret_cast<__m64*>(d + (c + 4) * MR), hi);
          }
        }
      }
    }
  }
#endif
  for (int64_t k = k0; k < K; ++k)
    for (int64_t r = 0; r < MR; ++r) dst[k * MR + r] = rows[r * ld + k];
}

// Writes rows [0, n_rows) of a matrix (row r at row_of(r), columns [0, n_cols)) transposed
// into panel-major K^T / V^T layout: element (c, r) at (r / NR) * n_cols * NR + c * NR + r % NR,
// one put_transposed_panel per NR rows. n_rows is a multiple of NR. One contiguous 8-lane store
// per column instead of 8 scalar stores 64 bytes apart: perf, forward loop at (4, 8, 512, 64):
// pack_kv 4.3% -> 3.9% of the samples; the rest of it is reading K and V from memory.
template <typename A, class RowOf>
inline void put_rows_transposed_panels_of(const RowOf& row_of, int64_t n_rows, int64_t n_cols, A* dst) {
  constexpr int64_t NR = MicroShape<A>::kNR;
  for (int64_t r0 = 0; r0 < n_rows; r0 += NR) {
    const A* rows[NR];
    for (int64_t r = 0; r < NR; ++r) rows[r] = row_of(r0 + r);
    put_transposed_panel<A, NR>(rows, n_cols, dst + (r0 / NR) * n_cols * NR);
  }
}

// |x|^2 of a row of n values (fp32 accumulation of the products, vector order).
template <typename T>
inline acc_t<T> squared_norm(const T* row, int64_t n) {
  using V = Vectorized<acc_t<T>>;
  V sum(acc_t<T>(0));
  int64_t d = 0;
  for (; d + V::size() <= n; d += V::size()) {
    const V x = load_acc(row + d);
    sum = at::vec::fmadd(x, x, sum);
  }
  if (d < n) {
    const V x = load_acc(row + d, n - d);
    sum = at::vec::fmadd(x, x, sum);
  }
  return reduce_add(sum);
}

// Packs key block kb of kv head (b, h) into block `blk` of packed head `dst_head`. fp32 / fp64
// inputs: the fp32 panels straight from the rows (kv_row: a view or a paged cache; a zero row
// past the block's keys). Other inputs: through the block's rows converted to fp32 (and, for the
// pair-word layouts, copied as bf16) in the calling thread's scratch. fp32 decoding step at B=1
// q=1 32/8 heads D=128 cache 4096 on the 2-core AMX Xeon, staged copy vs straight: see
// benchmarks/RESULTS.md (Decoding).
template <typename T, typename A>
void pack_kv_block(const AttnArgs& a, const Shape<A>& sh, Packed<A>& pk, int64_t b, int64_t h,
                   int64_t kb, int64_t dst_head, int64_t blk) {
  // Only the block's score columns (Shape::block_cols): the panels of a short last block past
  // them are never read (its tile GEMMs stop there), so they are not written either.
  const int64_t k0 = kb * kBlockK, n_keys = sh.block_keys(kb), cols = sh.block_cols(n_keys);
  // The block's largest |k_j|^2 (forward), from the rows as they are read here (in cache).
  // NaN keys are skipped: their scores are NaN whatever the shift.
  const auto largest_norm2 = [&](const auto& key_row) {
    A largest = 0;
    for (int64_t j = 0; j < n_keys; ++j) largest = std::max(largest, squared_norm(key_row(j), sh.D));
    pk.k_norm2[dst_head * pk.blocks + blk] = largest;
  };
  if constexpr (std::is_same_v<T, A>) {
    const A* const zeros = zero_row<A>(std::max(sh.D_pad, sh.Dv_pad));
    const auto key = [&](int64_t j) -> const A* { return j < n_keys ? kv_row<T>(a, a.k, b, h, k0 + j) : zeros; };
    const auto value = [&](int64_t j) -> const A* { return j < n_keys ? kv_row<T>(a, a.v, b, h, k0 + j) : zeros; };
    if (pk.k_norm2) largest_norm2(key);
    if (pk.kt) put_rows_transposed_panels_of(key, cols, sh.D, pk.kt_block(dst_head, blk));
    if (pk.vt) put_rows_transposed_panels_of(value, cols, sh.Dv, pk.vt_block(dst_head, blk));
    if (pk.vp || pk.kp) {  // column panels read whole NR-wide rows: rows off that width are padded
      A* const padded = thread_scratch<A, Scratch::kPackPaddedRow>(std::max(sh.D_pad, sh.Dv_pad));
      const auto whole = [&](const A* row, int64_t n, int64_t n_pad) {
        if (n == n_pad) return row;
        load_row(row, n, n_pad, padded);
        return static_cast<const A*>(padded);
      };
      for (int64_t j = 0; j < cols; ++j) {
        if (pk.vp) put_row_panels(pk.vp_block(dst_head, blk), sh.Bk_pad, j, whole(value(j), sh.Dv, sh.Dv_pad), sh.Dv_pad);
        if (pk.kp) put_row_panels(pk.kp_block(dst_head, blk), sh.Bk_pad, j, whole(key(j), sh.D, sh.D_pad), sh.D_pad);
      }
    }
    return;
  }
  A* const k_rows = thread_scratch<A, Scratch::kPackKRows>(sh.Bk_pad * sh.D_pad);
  A* const v_rows = thread_scratch<A, Scratch::kPackVRows>(sh.Bk_pad * sh.Dv_pad);
  const bool k_fp32 = pk.kt || pk.kp, v_fp32 = pk.vt || pk.vp;
  if (pk.k_norm2) pk.k_norm2[dst_head * pk.blocks + blk] = std::numeric_limits<A>::infinity();  // (until computed)
  for (int64_t j = 0; j < cols; ++j) {
    A* k_row = k_rows + j * sh.D_pad;
    A* v_row = v_rows + j * sh.Dv_pad;
    if (j < n_keys) {
      if (k_fp32) load_row(kv_row<T>(a, a.k, b, h, k0 + j), sh.D, sh.D_pad, k_row);
      if (v_fp32) load_row(kv_row<T>(a, a.v, b, h, k0 + j), sh.Dv, sh.Dv_pad, v_row);
    } else {
      if (k_fp32) std::fill(k_row, k_row + sh.D_pad, A(0));
      if (v_fp32) std::fill(v_row, v_row + sh.Dv_pad, A(0));
    }
  }
  TORCH_INTERNAL_ASSERT(!a.block_table || !(pk.kw || pk.vw || pk.vpw || pk.kpw), "paged caches take the fp32 path");
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Pair words from the bf16 rows themselves (zero rows past the block's keys and for the
    // keys no query sees, Shape::first_seen_key).
    const int64_t seen_begin = std::max<int64_t>(0, sh.first_seen_key() - k0);
    const int64_t seen_end = std::min(n_keys, sh.end_seen_key() - k0);
    auto stage = [&](const View4& view, int64_t n, int64_t n_bf16) {
      c10::BFloat16* const rows = thread_scratch<c10::BFloat16, Scratch::kPackBf16Rows>(cols * n_bf16);
      stage_bf16_rows(view, b, h, k0, seen_begin, seen_end, cols, n, n_bf16, rows);
      return rows;
    };
    if (pk.kw || pk.kpw) {
      const c10::BFloat16* k_bf16 = stage(a.k, sh.D, sh.D_bf16);  // (zero rows for keys no query sees)
      if (pk.k_norm2) largest_norm2([&](int64_t j) { return k_bf16 + j * sh.D_bf16; });
      if (pk.kw) put_rows_pair_panels(k_bf16, sh.D_bf16, cols, sh.D_bf16, pk.kw_block(dst_head, blk));
      if (pk.kpw) put_row_pairs_panels(k_bf16, sh.D_bf16, cols, sh.D_bf16, pk.kpw_block(dst_head, blk));
    }
    if (pk.vw || pk.vpw) {
      const c10::BFloat16* v_bf16 = stage(a.v, sh.Dv, sh.Dv_bf16);
      if (pk.vw) put_rows_pair_panels(v_bf16, sh.Dv_bf16, cols, sh.Dv_bf16, pk.vw_block(dst_head, blk));
      if (pk.vpw) put_row_pairs_panels(v_bf16, sh.Dv_bf16, cols, sh.Dv_bf16, pk.vpw_block(dst_head, blk));
    }
  }
  const auto staged = [](const A* rows, int64_t ld) { return [=](int64_t j) { return rows + j * ld; }; };
  if (pk.k_norm2 && k_fp32) largest_norm2(staged(k_rows, sh.D_pad));
  if (pk.kt) put_rows_transposed_panels_of(staged(k_rows, sh.D_pad), cols, sh.D, pk.kt_block(dst_head, blk));
  if (pk.vt) put_rows_transposed_panels_of(staged(v_rows, sh.Dv_pad), cols, sh.Dv, pk.vt_block(dst_head, blk));
  for (int64_t j = 0; j < cols; ++j) {
    if (pk.vp) put_row_panels(pk.vp_block(dst_head, blk), sh.Bk_pad, j, v_rows + j * sh.Dv_pad, sh.Dv_pad);
    if (pk.kp) put_row_panels(pk.kp_block(dst_head, blk), sh.Bk_pad, j, k_rows + j * sh.D_pad, sh.D_pad);
  }
}

// Every (batch, kv head, key block) into pk (heads = B * Hkv, blocks = n_kb), in parallel.
template <typename T, typename A>
void pack_kv(const AttnArgs& a, const Shape<A>& sh, Packed<A>& pk) {
  // Grain: ~64K packed values per task; smaller problems pack on the calling thread (waking a
  // sleeping OpenMP worker costs ~0.1-1 ms on this VM, more than packing a small head).
  const int64_t grain = std::max<int64_t>(1, 65536 / (kBlockK * (sh.D + sh.Dv)));
  at::parallel_for(0, sh.B * sh.Hkv * sh.n_kb, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / sh.n_kb, kb = t % sh.n_kb;
      pack_kv_block<T, A>(a, sh, pk, bh / sh.Hkv, bh % sh.Hkv, kb, bh, kb);
    }
  });
}

// Whether the forward of a call is decoding (attention_decode.cpp): few queries per kv head
// (a tile's rows: every query of the kv head's query heads, up to one 144-row block), no dropout
// and one sequence per batch row.
inline bool decodes(const AttnArgs& a) {
  const int64_t G = a.Hkv > 0 ? a.H / a.Hkv : 1;
  return a.Lq <= 16 && G * a.Lq <= kBlockQ && a.dropout_p == 0.0 && !a.cu_q && a.Lk > 0;
}
void attention_decode(const AttnArgs& args);

// Runs task(t) for t in [0, n) on all threads, handing out tasks one at a time: causal tiles
// differ in cost, and a static split would leave one core idle (or wait on a busy core).
// equal_tasks: each thread a fixed contiguous range of the tasks (the same range every call for
// the same n: the decode kernel's heads, whose cache a core may still hold), for tasks of about
// one cost.
// Below ~2 MFLOP of total work everything runs on the calling thread (see pack_kv).
template <typename F>
void parallel_tasks(int64_t n, double total_flops, F&& task, bool equal_tasks = false) {
  if (total_flops < 2e6 || n == 1) {
    for (int64_t t = 0; t < n; ++t) task(t);
    return;
  }
  if (equal_tasks) {
    at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) task(t);
    });
    return;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) task(t);
  });
}

}  // namespace attn
}  // namespace fastformer::cpu::CPU_CAPABILITY
