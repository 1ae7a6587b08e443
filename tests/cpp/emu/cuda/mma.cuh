// Emulated stand-in for csrc/cuda/mma.cuh (found first on the include path of the emulator
// build): the same functions, evaluated as warp collectives with the layouts PTX documents
// for ldmatrix.m8n8.x4[.trans].b16 and mma.m16n8k16.row.col.f32.{f16,bf16}. Row addresses
// must lie in shared memory and be 16-byte aligned, as on the hardware.
#pragma once
#include "emu_prelude.h"

namespace fastformer::cuda {

namespace emu_detail {

inline uint16_t load_u16(uintptr_t addr) {
  uint16_t v;
  memcpy(&v, reinterpret_cast<const void*>(addr), 2);
  return v;
}

__attribute__((noinline)) inline void ldmatrix(uint32_t (&r)[4], const void* row_addr, bool trans) {
  ::emu::check_smem(row_addr, 16, "ldmatrix row address outside shared memory");
  if (reinterpret_cast<uintptr_t>(row_addr) % 16)
    ::emu::fail("ldmatrix row address not 16-byte aligned");
  const uint64_t a = reinterpret_cast<uintptr_t>(row_addr);
  const uint32_t in[2] = {static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32)};
  const uint32_t* out = ::emu::warp_collective(
      trans ? 2 : 1, in, 2,
      [&](uint32_t (&w)[32][::emu::kMaxWords], uint32_t (&o)[32][::emu::kMaxWords]) {
        auto row = [&](int lane) {
          return (static_cast<uintptr_t>(w[lane][1]) << 32) | w[lane][0];
        };
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          for (int m = 0; m < 4; ++m) {
            uint16_t lo, hi;
            if (!trans) {  // (row g, cols 2t, 2t + 1)
              lo = load_u16(row(8 * m + g) + 2 * (2 * t));
              hi = load_u16(row(8 * m + g) + 2 * (2 * t + 1));
            } else {  // (rows 2t, 2t + 1; col g)
              lo = load_u16(row(8 * m + 2 * t) + 2 * g);
              hi = load_u16(row(8 * m + 2 * t + 1) + 2 * g);
            }
            o[lane][m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
        }
      });
  for (int m = 0; m < 4; ++m) r[m] = out[m];
}

template <typename T>
inline float to_f(uint16_t bits);
template <>
inline float to_f<__half>(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}
template <>
inline float to_f<__nv_bfloat16>(uint16_t bits) {
  __nv_bfloat16_raw r;
  r.x = bits;
  return __bfloat162float(__nv_bfloat16(r));
}

}  // namespace emu_detail

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  emu_detail::ldmatrix(r, row_addr, false);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  emu_detail::ldmatrix(r, row_addr, true);
}

template <typename T>
__attribute__((noinline)) inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
  uint32_t in[10] = {a[0], a[1], a[2], a[3], b0, b1};
  memcpy(in + 6, d, 16);
  const uint32_t* out = ::emu::warp_collective(
      3, in, 10, [&](uint32_t (&w)[32][::emu::kMaxWords], uint32_t (&o)[32][::emu::kMaxWords]) {
        float A[16][16], B[16][8], C[16][8];
        auto lo = [](uint32_t v) { return emu_detail::to_f<T>(static_cast<uint16_t>(v)); };
        auto hi = [](uint32_t v) { return emu_detail::to_f<T>(static_cast<uint16_t>(v >> 16)); };
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          const uint32_t* x = w[lane];
          for (int r = 0; r < 4; ++r) {  // a[r]: rows g (+8 if r odd), cols 2t (+8 if r >= 2)
            const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
            A[row][col] = lo(x[r]);
            A[row][col + 1] = hi(x[r]);
          }
          B[2 * t][g] = lo(x[4]);
          B[2 * t + 1][g] = hi(x[4]);
          B[2 * t + 8][g] = lo(x[5]);
          B[2 * t + 9][g] = hi(x[5]);
          float c[4];
          memcpy(c, x + 6, 16);
          C[g][2 * t] = c[0];
          C[g][2 * t + 1] = c[1];
          C[g + 8][2 * t] = c[2];
          C[g + 8][2 * t + 1] = c[3];
        }
        for (int i = 0; i < 16; ++i)
          for (int j = 0; j < 8; ++j) {
            float acc = C[i][j];
            for (int k = 0; k < 16; ++k) acc += A[i][k] * B[k][j];
            C[i][j] = acc;
          }
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          const float c[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
          memcpy(o[lane], c, 16);
        }
      });
  memcpy(d, out, 16);
}

template <typename T>
inline uint32_t pack2(float lo, float hi);
template <>
inline uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}
template <>
inline uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  ::emu::cp_async_16(smem, gmem, valid);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() { ::emu::cp_async_wait_all(); }

}  // namespace fastformer::cuda
