// Philox4x32-10 dropout words for runs of consecutive elements, 16 counters (64 words) at a
// time at the AVX-512 level and 8 (32 words) with AVX2, bit-identical to common/philox.h's
// scalar philox_word, which stays the definition (and the DEFAULT level's loop):
//
//   words[j] = philox_word(base + j, seed)   for j in [0, n)
//
// Element e takes word e % 4 of Philox at counter e / 4, so a run of 64 elements is 16
// counters: the four output vectors of 16 lanes are interleaved (a 4 x 4 transpose of 32-bit
// words within 128-bit lanes, then of the lanes) into 64 words in element order. A run that
// does not start on a multiple of 4, or ends inside a block, takes its part of a block through
// a 64-word buffer.
// Per round and 8 counters: 4 vpmuludq (the 32x32->64 products of the even and odd lanes
// by the two Philox multipliers) give both the high halves (mulhi) and the low halves (the
// plain products) after 4 blends, then 4 xors. The 64-bit counter's low word is
// first_lo + lane; a lane whose low word wrapped carries into the high word.
// Measured on the 2-core Xeon (AVX-512): one word per counter, an attention forward with
// dropout at (8, 8, 512, 64) bf16 took 22.0 ms against 5.6 without, and dropout was 229 ms of
// a converted BERT-base bf16 training step of 820 (4 x 256 tokens).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common/philox.h"

namespace fastformer::cpu::CPU_CAPABILITY {

// The ten rounds' key words of a seed (philox4's k0, k1 schedule), the same for every run.
struct PhiloxKeys {
  uint32_t k0[10], k1[10];
  explicit PhiloxKeys(uint64_t seed) {
    uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round, a += 0x9E3779B9u, b += 0xBB67AE85u) {
      k0[round] = a;
      k1[round] = b;
    }
  }
};

// Copies the words of elements [skip, skip + take) of a block that starts at a multiple of 4
// (its words in `block`, element order) to words + j; stores whole blocks directly.
template <int kBlock>
inline int64_t take_from_block(const uint32_t* block, int skip, int64_t j, int64_t n, uint32_t* words) {
  const int64_t take = std::min<int64_t>(kBlock - skip, n - j);
  std::memcpy(words + j, block + skip, static_cast<size_t>(take) * sizeof(uint32_t));
  return take;
}

inline void philox_words(uint64_t base, uint64_t seed, int64_t n, uint32_t* words) {
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
    const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    constexpr __mmask16 kOdd = 0xAAAA;
    const PhiloxKeys keys(seed);
    __m512i round_key0[10], round_key1[10];
    for (int round = 0; round < 10; ++round) {
      round_key0[round] = _mm512_set1_epi32(static_cast<int>(keys.k0[round]));
      round_key1[round] = _mm512_set1_epi32(static_cast<int>(keys.k1[round]));
    }
    // (even-lane products' high halves, odd lanes' products' high halves) and the low halves
    const auto mulhilo = [&](const __m512i& m, const __m512i& v, __m512i& hi, __m512i& lo) {
      const __m512i even = _mm512_mul_epu32(m, v), odd = _mm512_mul_epu32(m, _mm512_srli_epi64(v, 32));
      hi = _mm512_mask_blend_epi32(kOdd, _mm512_srli_epi64(even, 32), odd);
      lo = _mm512_mask_blend_epi32(kOdd, even, _mm512_slli_epi64(odd, 32));
    };
    alignas(64) uint32_t block[64];
    while (j < n) {
      const uint64_t element = base + static_cast<uint64_t>(j);
      const int skip = static_cast<int>(element & 3);
      const uint64_t first = element >> 2;
      const __m512i first_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first)));
      const __m512i counter_lo = _mm512_add_epi32(first_lo, lane);
      const __mmask16 wrapped = _mm512_cmplt_epu32_mask(counter_lo, first_lo);
      const __m512i first_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first >> 32)));
      const __m512i counter_hi = _mm512_mask_add_epi32(first_hi, wrapped, first_hi, _mm512_set1_epi32(1));
      // Round 0 with c2 = c3 = 0: the products by c2 vanish.
      __m512i c0 = _mm512_xor_si512(counter_hi, round_key0[0]), c1 = _mm512_setzero_si512(), c2, c3;
      mulhilo(mul1, counter_lo, c2, c3);
      c2 = _mm512_xor_si512(c2, round_key1[0]);
      for (int round = 1; round < 10; ++round) {
        __m512i hi0, lo0, hi1, lo1;
        mulhilo(mul0, c2, hi0, lo0);
        mulhilo(mul1, c0, hi1, lo1);
        c0 = _mm512_ternarylogic_epi32(hi0, c1, round_key0[round], 0x96);  // three-way xor
        c2 = _mm512_ternarylogic_epi32(hi1, c3, round_key1[round], 0x96);
        c1 = lo0;
        c3 = lo1;
      }
      // Element order: per 128-bit lane L, u_i holds counter 4L + i's (c0, c1, c2, c3); then
      // out_m = counters 4m .. 4m + 3 (lane L of u_0 .. u_3 for L = m).
      const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
      const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
      const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
      const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
      const __m512i u01_lo = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i u01_hi = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i u23_lo = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i u23_hi = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i out[4] = {_mm512_shuffle_i32x4(u01_lo, u23_lo, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_i32x4(u01_lo, u23_lo, _MM_SHUFFLE(3, 1, 3, 1)),
                              _mm512_shuffle_i32x4(u01_hi, u23_hi, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_i32x4(u01_hi, u23_hi, _MM_SHUFFLE(3, 1, 3, 1))};
      if (skip == 0 && j + 64 <= n) {
        for (int m = 0; m < 4; ++m) _mm512_storeu_si512(words + j + 16 * m, out[m]);
        j += 64;
      } else {
        for (int m = 0; m < 4; ++m) _mm512_store_si512(block + 16 * m, out[m]);
        j += take_from_block<64>(block, skip, j, n, words);
      }
    }
  }
#elif defined(__AVX2__)
  {
    const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
    const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const PhiloxKeys keys(seed);
    __m256i round_key0[10], round_key1[10];
    for (int round = 0; round < 10; ++round) {
      round_key0[round] = _mm256_set1_epi32(static_cast<int>(keys.k0[round]));
      round_key1[round] = _mm256_set1_epi32(static_cast<int>(keys.k1[round]));
    }
    const auto mulhilo = [&](const __m256i& m, const __m256i& v, __m256i& hi, __m256i& lo) {
      const __m256i even = _mm256_mul_epu32(m, v), odd = _mm256_mul_epu32(m, _mm256_srli_epi64(v, 32));
      hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
      lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    };
    alignas(32) uint32_t block[32];
    while (j < n) {
      const uint64_t element = base + static_cast<uint64_t>(j);
      const int skip = static_cast<int>(element & 3);
      const uint64_t first = element >> 2;
      const __m256i first_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first)));
      const __m256i counter_lo = _mm256_add_epi32(first_lo, lane);
      // wrapped (unsigned counter_lo < first_lo) -> -1, subtracted from the high word: +1
      const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(first_lo, sign),
                                                 _mm256_xor_si256(counter_lo, sign));
      const __m256i counter_hi = _mm256_sub_epi32(
          _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first >> 32))), wrapped);
      // Round 0 with c2 = c3 = 0: the products by c2 vanish.
      __m256i c0 = _mm256_xor_si256(counter_hi, round_key0[0]), c1 = _mm256_setzero_si256(), c2, c3;
      mulhilo(mul1, counter_lo, c2, c3);
      c2 = _mm256_xor_si256(c2, round_key1[0]);
      for (int round = 1; round < 10; ++round) {
        __m256i hi0, lo0, hi1, lo1;
        mulhilo(mul0, c2, hi0, lo0);
        mulhilo(mul1, c0, hi1, lo1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi0, c1), round_key0[round]);
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi1, c3), round_key1[round]);
        c1 = lo0;
        c3 = lo1;
      }
      // Per 128-bit lane L, u_i holds counter 4L + i's words; out = counters (0, 1), (2, 3),
      // (4, 5), (6, 7).
      const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
      const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
      const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
      const __m256i out[4] = {_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u2, u3, 0x20),
                              _mm256_permute2x128_si256(u0, u1, 0x31), _mm256_permute2x128_si256(u2, u3, 0x31)};
      if (skip == 0 && j + 32 <= n) {
        for (int m = 0; m < 4; ++m) _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + j + 8 * m), out[m]);
        j += 32;
      } else {
        for (int m = 0; m < 4; ++m) _mm256_store_si256(reinterpret_cast<__m256i*>(block + 8 * m), out[m]);
        j += take_from_block<32>(block, skip, j, n, words);
      }
    }
  }
#endif
  uint32_t block[4];
  while (j < n) {  // the DEFAULT level: one Philox call per 4 elements
    const uint64_t element = base + static_cast<uint64_t>(j);
    philox4(element >> 2, seed, block);
    j += take_from_block<4>(block, static_cast<int>(element & 3), j, n, words);
  }
}

// v[j] = 0 where words[j] < threshold (dropped), for j < n: an unsigned compare per lane, 16
// at a time at the AVX-512 level (the FFN's ReLU + dropout pass over (4096, 2048) bf16 on the
// 2-core Xeon: 15.3 ms with the scalar loop, 9.2 with this).
template <typename A>
inline void zero_dropped(const uint32_t* words, int64_t n, uint32_t threshold, A* v) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    const __m512i t = _mm512_set1_epi32(static_cast<int>(threshold));
    for (; j + 16 <= n; j += 16) {
      const __mmask16 keep = _mm512_cmpge_epu32_mask(_mm512_loadu_si512(words + j), t);
      _mm512_storeu_ps(v + j, _mm512_maskz_mov_ps(keep, _mm512_loadu_ps(v + j)));
    }
  }
#endif
  for (; j < n; ++j) v[j] = words[j] < threshold ? A(0) : v[j];
}

}  // namespace fastformer::cpu::CPU_CAPABILITY
