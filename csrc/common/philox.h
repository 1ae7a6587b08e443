// Counter-based RNG for dropout: Philox4x32-10 (Salmon et al., SC'11), the generator of
// curand, torch's CUDA RNG and Triton's tl.randint.
//
// One random 32-bit word per element: counter = (offset + element index) as a 64-bit number
// split into (c0 = low, c1 = high, c2 = 0, c3 = 0), key = the 64-bit seed split into
// (k0 = low, k1 = high); the word is c0 after 10 rounds. This is exactly tl.randint(seed,
// offset) for a 64-bit offset, so the CPU, CUDA, Triton and reference backends (the last in
// fastformer/reference/rng.py) draw the same mask, and a backward regenerates its forward's mask
// from (seed, offset) without storing it.
//
// An element is kept iff word >= dropout_threshold(p), with threshold = round(p * 2^32):
// integer comparison, so every backend agrees bit for bit; P(keep) = 1 - p up to 2^-32.
#pragma once
#include "ff_common.h"

namespace fastformer {

FF_HOST_DEVICE uint32_t mulhi_u32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

FF_HOST_DEVICE uint32_t philox_word(uint64_t counter, uint64_t seed) {
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
  return c0;
}

// Words below this are dropped. p in [0, 1).
FF_HOST_DEVICE uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0 + 0.5;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace fastformer
