// Packed (varlen) and KV-cache calls as one B = 1 call per sequence: the views, lengths, lse,
// slopes, option gradients and dropout stream of each sequence (split_sequences), a paged
// cache's keys and values copied out of their pages (gather_pages), and the zero gradients of
// sequences without queries or keys (zero_rows). No kernel work: O(sequences) arithmetic on
// the call's arguments, plus the O(Lk * D) page copy.
#pragma once

#include <algorithm>
#include <vector>

#include "cpu/attention_common.h"

namespace fastformer::cpu::CPU_CAPABILITY {
namespace attn {

// A view moved by `rows` rows (dim 2) and `batches` batch rows (dim 0); elements of `elem` bytes.
inline View4 shifted(View4 v, int64_t batches, int64_t rows, int64_t elem) {
  if (v.ptr) v.ptr = static_cast<const char*>(v.ptr) + (batches * v.s[0] + rows * v.s[2]) * elem;
  return v;
}

// The calls of a packed call (cu_q / cu_k: sequence s) or a KV-cache call (k_lens and k_starts:
// batch row s), one per sequence, B = 1: lengths, views, lse, slopes and the dropout stream moved to the
// sequence (stream offsets: the sum of the earlier sequences' H * Lq * Lk, as
// reference/varlen.py).
inline std::vector<AttnArgs> split_sequences(const AttnArgs& a) {
  const int64_t S = a.cu_q ? a.n_seqs : a.B;
  const int64_t elem = dtype_size(a.dtype), acc = a.dtype == DType::f64 ? 8 : 4;
  std::vector<AttnArgs> out;
  out.reserve(S);
  uint64_t stream = a.offset;
  for (int64_t s = 0; s < S; ++s) {
    AttnArgs e = a;
    e.cu_q = e.cu_k = e.k_lens = e.k_starts = nullptr;
    e.n_seqs = 0;
    e.B = 1;
    int64_t qb = s, qr = 0, kb = s, kr = 0;  // batch rows and rows moved
    if (a.cu_q) {
      qb = kb = 0;
      qr = a.cu_q[s];
      kr = a.cu_k[s];
      e.Lq = a.cu_q[s + 1] - qr;
      e.Lk = a.cu_k[s + 1] - kr;
      if (e.dsinks) e.dsinks = static_cast<char*>(e.dsinks) + s * a.H * acc;  // (S, H) parts
    } else {
      const int64_t start = a.k_starts ? a.k_starts[s] : 0;
      e.Lk = a.k_lens[s] - start;
      if (a.block_table) {  // the pages stay where they are; the row's table and start move
        kb = 0;
        e.block_table += s * a.bt_stride;
        if (a.k_starts) e.k_starts = a.k_starts + s;
      } else {
        kr = start;
      }
      if (e.key_padding_mask) e.key_padding_mask += s * a.kpm_s[0];
      e.attn_mask = shifted(e.attn_mask, s, 0, e.mask_is_bool ? 1 : dtype_size(e.mask_dtype));
    }
    for (View4* v : {&e.q, &e.out, &e.out_residual, &e.dout, &e.dq}) *v = shifted(*v, qb, qr, elem);
    for (View4* v : {&e.k, &e.v, &e.dk, &e.dv}) *v = shifted(*v, kb, kr, elem);
    if (e.lse) e.lse = static_cast<char*>(e.lse) + (qb * a.lse_s[0] + qr) * acc;
    if (e.alibi_slopes) e.alibi_slopes += s * a.alibi_s[0];
    e.offset = stream;
    stream += static_cast<uint64_t>(a.H * e.Lq * e.Lk);
    out.push_back(e);
  }
  return out;
}

// The keys and values of a B = 1 paged call copied out of their pages into `buf` as
// (Hkv, Lk, D) and (Hkv, Lk, Dv): the layout the flash kernels read (their bf16 GEMM path stages
// bf16 rows straight from the views). O(Lk * D), beside the call's O(Lq * Lk * D).
template <typename T>
AttnArgs gather_pages(AttnArgs s, std::vector<T>& buf) {
  buf.resize(s.Hkv * s.Lk * (s.D + s.Dv));
  T* const keys = buf.data();
  T* const values = keys + s.Hkv * s.Lk * s.D;
  for (int64_t h = 0; h < s.Hkv; ++h)
    for (int64_t j = 0; j < s.Lk; ++j) {
      const T* k_row = kv_row<T>(s, s.k, 0, h, j);
      const T* v_row = kv_row<T>(s, s.v, 0, h, j);
      std::copy(k_row, k_row + s.D, keys + (h * s.Lk + j) * s.D);
      std::copy(v_row, v_row + s.Dv, values + (h * s.Lk + j) * s.Dv);
    }
  s.k = View4{keys, {s.Hkv * s.Lk * s.D, s.Lk * s.D, s.D, 1}};
  s.v = View4{values, {s.Hkv * s.Lk * s.Dv, s.Lk * s.Dv, s.Dv, 1}};
  s.block_table = nullptr;
  s.k_starts = nullptr;  // the copies begin at the row's first key
  return s;
}

// Zeroes rows [0, L) of heads [0, H) of a B = 1 view, n elements each (sequences without keys
// or without queries).
template <typename T>
void zero_rows(const View4& v, int64_t H, int64_t L, int64_t n) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t l = 0; l < L; ++l) {
      T* row = const_cast<T*>(row_ptr<T>(v, 0, h, l));
      std::fill(row, row + n, T(0));
    }
}

}  // namespace attn
}  // namespace fastformer::cpu::CPU_CAPABILITY
