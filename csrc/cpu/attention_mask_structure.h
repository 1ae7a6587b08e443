// What the CPU flash attention (attention_fwd.cpp, attention_bwd.cpp) learns from a bool mask's
// values before it runs, so that a materialized pattern costs what the pattern itself costs.
//
// fold_band_mask: a bool mask that is exactly a band (every query row attends the keys
// [i - left, i + right] clipped to [0, Lk), the same left >= 0 and right >= 0 for every row,
// batch and head) is replaced by window = (left, right) without causality: the window's tiles
// then skip their micro-tiles outside the band and take the unmasked path inside it. One read
// of the mask (each row scanned once, stopping at its first row off the pattern).
// A (1, 8, 4096, 64) causal band of 512 keys given as a bool mask, fp32 forward+backward on a
// 2-core Zen 5, one process: 69 ms folded, 105 ms through the tile map below alone, 63 ms as
// window = (512, 0), torch SDPA given the same mask 1046 ms.
//
// MaskTiles: the state of every tile under a bool mask and the key padding. Tiles they exclude
// wholly (every (query, key) pair masked) both passes skip as they skip the tiles outside the
// band: such a tile's P and dS are 0, so it adds nothing to any sum, and a query row whose
// every tile is skipped is a fully masked row (zeros, lse +inf), as it was when the tiles were
// visited. Both matter for Hugging Face models under torch.compile: traced, they hand their
// sliding window over as a (B, 1, L, L) bool mask (the mask function cannot be read back as a
// window), an exact band without padding, a tile pattern with it; chunked and document masks
// are tile patterns too.
//
// Float masks are not mapped: their -inf is added to the score, so NaN and +inf scores under
// it stay NaN as in eager PyTorch, which a skipped tile would lose.
// The map also marks the tiles the bool mask attends wholly (and no key of which is padding,
// without a float mask): they take the unmasked path, P straight from S with one FMA, as if
// there were no mask (Shape::unmasked).
//
// The map is built once per call, one byte per (mask batch, mask head, query block, key block):
// the mask's broadcast dims are read once (a (B, 1, Lq, Lk) mask for every head), a row that
// broadcasts over queries once per tile, and a tile's scan stops at its first attended pair,
// so the cost is at most one read of the mask's own elements (a dead tile reads all of its
// 144 x 192 bytes), against the tile's 2 x 144 x 192 x (D + Dv) flops.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/attention_common.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace attn {

namespace band_detail {
// Row i of a bool mask over [0, n): whether it is true exactly on one run [first, last]
// (returned), false elsewhere; {-1, -1} if it is not (or is all false).
inline std::pair<int64_t, int64_t> single_run(const bool* row, int64_t n, int64_t step) {
  if (step == 1) {  // bools are bytes 0 or 1: memchr finds the 1s, the run is read 8 at a time
    const void* hit = std::memchr(row, 1, n);
    if (!hit) return {-1, -1};
    const int64_t first = static_cast<const bool*>(hit) - row;
    int64_t last = first;
    while (last + 9 <= n && bools8(row + last + 1) == kTrueBools8) last += 8;
    while (last + 1 < n && row[last + 1]) ++last;
    if (last + 1 < n && std::memchr(row + last + 1, 1, n - last - 1)) return {-1, -1};
    return {first, last};
  }
  int64_t first = 0;
  while (first < n && !row[first * step]) ++first;
  if (first == n) return {-1, -1};
  int64_t last = first;
  while (last + 1 < n && row[(last + 1) * step]) ++last;
  for (int64_t j = last + 1; j < n; ++j)
    if (row[j * step]) return {-1, -1};
  return {first, last};
}
}  // namespace band_detail

// Replaces a band-shaped bool mask by the equivalent window (see the header); returns whether
// it did. Calls with causality, a window or no bool mask are left as they are.
inline bool fold_band_mask(AttnArgs& a) {
  if (!a.attn_mask.ptr || !a.mask_is_bool || a.causal != 0 || a.window_left != -1 || a.window_right != -1 ||
      a.Lq < 2 || a.Lk == 0 || a.attn_mask.s[2] == 0)
    return false;
  const int64_t* s = a.attn_mask.s;
  const int64_t batches = s[0] != 0 ? a.B : 1, heads = s[1] != 0 ? a.H : 1;
  std::vector<std::pair<int64_t, int64_t>> runs(batches * heads * a.Lq);
  std::atomic<bool> off_pattern{false};  // a fully masked row, or a row of more than one run
  at::parallel_for(0, batches * heads * a.Lq, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end && !off_pattern.load(std::memory_order_relaxed); ++r) {
      const int64_t bh = r / a.Lq, i = r % a.Lq;
      const bool* row = static_cast<const bool*>(a.attn_mask.ptr) + bh / heads * s[0] + bh % heads * s[1] + i * s[2];
      runs[r] = band_detail::single_run(row, a.Lk, s[3]);
      if (runs[r].first < 0) off_pattern = true;
    }
  });
  if (off_pattern) return false;
  // The window's sides from the rows the ends of the keys do not clip (-1: no row is bounded
  // on that side, no limit); then every row must be the band's (which also rejects a run
  // starting past its query or ending before it: no window >= 0 gives those).
  int64_t left = -1, right = -1;
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    const int64_t i = r % a.Lq;
    if (runs[r].first > 0 && left < 0) left = i - runs[r].first;
    if (runs[r].second < a.Lk - 1 && right < 0) right = runs[r].second - i;
  }
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    const int64_t i = r % a.Lq;
    const int64_t first = left < 0 ? 0 : std::max<int64_t>(0, i - left);
    const int64_t last = right < 0 ? a.Lk - 1 : std::min<int64_t>(a.Lk - 1, i + right);
    if (runs[r].first != first || runs[r].second != last) return false;
  }
  a.window_left = left;
  a.window_right = right;
  a.attn_mask = View4{};
  return true;
}

class MaskTiles {
 public:
  enum State : uint8_t { kPartial = 0, kDead = 1, kFull = 2 };
  MaskTiles() = default;
  // Tiles of kBlockQ queries x kBlockK keys (the passes' tile sizes) over an (Lq, Lk) call.
  MaskTiles(const AttnArgs& a, int64_t block_q, int64_t block_k) {
    const bool bool_mask = a.attn_mask.ptr && a.mask_is_bool;
    if ((!bool_mask && !a.key_padding_mask) || a.Lq == 0 || a.Lk == 0) return;
    const bool float_mask = a.attn_mask.ptr && !a.mask_is_bool;
    block_q_ = block_q;
    const int64_t n_qb = (a.Lq + block_q - 1) / block_q;
    n_kb_ = (a.Lk + block_k - 1) / block_k;
    const int64_t heads = bool_mask && a.attn_mask.s[1] != 0 ? a.H : 1;
    const int64_t batches = (bool_mask && a.attn_mask.s[0] != 0) || a.key_padding_mask ? a.B : 1;
    s_h_ = heads > 1 ? n_qb * n_kb_ : 0;
    s_b_ = batches > 1 ? heads * n_qb * n_kb_ : 0;
    map_.assign(batches * heads * n_qb * n_kb_, kPartial);
    at::parallel_for(0, batches * heads * n_qb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bh = t / n_qb, qb = t % n_qb, b = bh / heads, h = bh % heads;
        const int64_t q0 = qb * block_q, q1 = std::min(a.Lq, q0 + block_q);
        for (int64_t kb = 0; kb < n_kb_; ++kb) {
          const int64_t k0 = kb * block_k, k1 = std::min(a.Lk, k0 + block_k);
          State state = kPartial;
          if ((a.key_padding_mask && all_keys(a, b, k0, k1, true)) || (bool_mask && all_pairs(a, b, h, q0, q1, k0, k1, false)))
            state = kDead;
          else if (!float_mask && (!a.key_padding_mask || all_keys(a, b, k0, k1, false)) &&
                   (!bool_mask || all_pairs(a, b, h, q0, q1, k0, k1, true)))
            state = kFull;
          map_[b * s_b_ + h * s_h_ + qb * n_kb_ + kb] = state;
        }
      }
    });
    on_ = true;
  }

  // The state of tile (the query block whose first row is q0, key block kb) of head (b, h):
  // kPartial when there is no map (no bool mask or key padding).
  State at(int64_t b, int64_t h, int64_t q0, int64_t kb) const {
    return on_ ? static_cast<State>(map_[b * s_b_ + h * s_h_ + q0 / block_q_ * n_kb_ + kb]) : kPartial;
  }

 private:
  // Whether the key padding of keys [k0, k1) of batch row b is `value` for all of them.
  static bool all_keys(const AttnArgs& a, int64_t b, int64_t k0, int64_t k1, bool value) {
    const bool* pad = a.key_padding_mask + b * a.kpm_s[0];
    for (int64_t j = k0; j < k1; ++j)
      if (pad[j * a.kpm_s[1]] != value) return false;
    return true;
  }
  // Whether the bool mask is `value` (true = attend) on every pair of queries [q0, q1) x keys
  // [k0, k1); the scan stops at the first pair that is not.
  static bool all_pairs(const AttnArgs& a, int64_t b, int64_t h, int64_t q0, int64_t q1, int64_t k0, int64_t k1,
                        bool value) {
    const int64_t* s = a.attn_mask.s;
    const bool* base = static_cast<const bool*>(a.attn_mask.ptr) + b * s[0] + h * s[1];
    const int64_t rows_end = s[2] == 0 ? q0 + 1 : q1;  // a mask broadcast over queries: one row
    const uint64_t word_of_value = value ? kTrueBools8 : 0;
    for (int64_t i = q0; i < rows_end; ++i) {
      const bool* row = base + i * s[2];
      if (s[3] == 0) {
        if (row[0] != value) return false;
        continue;
      }
      int64_t j = k0;
      if (s[3] == 1) {
        // 64 bools at a time: all equal `value` iff their words' AND and OR both are its word.
        for (; j + 64 <= k1; j += 64) {
          uint64_t all = ~0ull, any = 0;
          for (int64_t w = 0; w < 64; w += 8) {
            all &= bools8(row + j + w);
            any |= bools8(row + j + w);
          }
          if (all != word_of_value || any != word_of_value) return false;
        }
      }
      for (; j < k1; ++j)
        if (row[j * s[3]] != value) return false;
    }
    return true;
  }

  std::vector<uint8_t> map_;
  int64_t s_b_ = 0, s_h_ = 0, n_kb_ = 0, block_q_ = 1;
  bool on_ = false;
};

}  // namespace attn
}  // namespace fastformer::cpu::CPU_CAPABILITY
