// Counter-based RNG for dropout: Philox4x32-10 (Salmon et al., SC'11), the generator of
// curand, torch's CUDA RNG and Triton's tl.randint4x.
//
// One random 32-bit word per element, four elements per Philox call: element e (the 64-bit
// number offset + element index) takes word e mod 4 of the four output words (c0, c1, c2, c3)
// of Philox at counter g = e / 4, split into (c0 = low 32 bits of g, c1 = high, c2 = 0, c3 = 0),
// key = the 64-bit seed split into (k0 = low, k1 = high). That is word e % 4 of
// tl.randint4x(seed, e // 4), so the CPU, Triton and reference backends (the last in
// fastformer/reference/rng.py) draw the same mask, and a backward regenerates its forward's mask
// from (seed, offset) without storing it. Using every word of a call quarters the rounds per
// element against one word per call: the rounds were most of a dropout pass on the CPU (see
// cpu/philox_vec.h for the figures).
//
// An element is kept iff word >= dropout_threshold(p), with threshold = round(p * 2^32):
// integer comparison, so every backend agrees bit for bit; P(keep) = 1 - p up to 2^-32.
#pragma once
#include "ff_common.h"

namespace fastformer {

FF_HOST_DEVICE uint32_t mulhi_u32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// The four words of Philox4x32-10 at 64-bit counter `counter` (c2 = c3 = 0) and key `seed`.
FF_HOST_DEVICE void philox4(uint64_t counter, uint64_t seed, uint32_t words[4]) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint32_t prev_c0 = c0, prev_c2 = c2;
    c0 = mulhi_u32(0xCD9E8D57u, prev_c2) ^ c1 ^ k0;
    c2 = mulhi_u32(0xD2511F53u, prev_c0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * prev_c2;
    c3 = 0xD2511F53u * prev_c0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  words[0] = c0;
  words[1] = c1;
  words[2] = c2;
  words[3] = c3;
}

// The dropout word of element e (the definition above; the vector loops of cpu/philox_vec.h
// compute runs of them).
FF_HOST_DEVICE uint32_t philox_word(uint64_t element, uint64_t seed) {
  uint32_t words[4];
  philox4(element >> 2, seed, words);
  return words[element & 3];
}

// Words below this are dropped. p in [0, 1).
FF_HOST_DEVICE uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0 + 0.5;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace fastformer
