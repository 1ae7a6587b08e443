// CPU bindings: attention forward and backward (dense, varlen, masks, biases, sinks).
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

inline cpu::View4 view4(const Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "fastformer._C: expected a 4-D tensor");
  cpu::View4 v;
  v.ptr = t.data_ptr();
  for (int i = 0; i < 4; ++i) v.s[i] = t.stride(i);
  return v;
}

// Packed sequences (cu_seqlens_q): the (total, H, D) tensors as the kernels' (1, H, total, D)
// views; other calls' tensors as they are.
inline Tensor heads_view(const Tensor& t, const AttentionOptions& o) {
  return present(o.cu_seqlens_q) ? t.unsqueeze(0).transpose(1, 2) : t;
}

inline const int32_t* int32_vector(const Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() && t.numel() == n,
              "fastformer._C: ", what, " must be a contiguous int32 vector of ", n, " entries");
  return t.data_ptr<int32_t>();
}

// The variable lengths of a call (ops/varlen.py): packed sequences or a KV cache (its rows'
// key counts, its pages). The Python side validated the values.
inline void attn_lengths(cpu::AttnArgs& a, const Tensor& k, const AttentionOptions& o) {
  const bool masked = present(o.attn_mask) || present(o.key_padding_mask) || present(o.rel_bias);
  if (const Tensor* cu_q = present(o.cu_seqlens_q)) {
    const Tensor* cu_k = present(o.cu_seqlens_k);
    TORCH_CHECK(cu_k && !masked && a.B == 1, "fastformer._C: packed sequences need cu_seqlens_k "
                "and take no attention mask, key padding mask or relative bias");
    a.n_seqs = cu_q->numel() - 1;
    a.cu_q = int32_vector(*cu_q, a.n_seqs + 1, "cu_seqlens_q");
    a.cu_k = int32_vector(*cu_k, a.n_seqs + 1, "cu_seqlens_k");
    TORCH_CHECK(a.cu_q[a.n_seqs] == a.Lq && a.cu_k[a.n_seqs] == a.Lk,
                "fastformer._C: cu_seqlens must end at the packed lengths");
  }
  if (const Tensor* lens = present(o.seqlens_k)) {
    TORCH_CHECK(!masked && a.dropout_p == 0.0, "fastformer._C: KV-cache calls take no masks, "
                "relative bias or dropout");
    a.k_lens = int32_vector(*lens, a.B, "seqlens_k");
    const Tensor* table = present(o.block_table);
    if (table) {
      TORCH_CHECK(table->scalar_type() == at::kInt && table->dim() == 2 && table->size(0) == a.B &&
                      table->stride(1) == 1,
                  "fastformer._C: block_table must be int32 (B, max_blocks) with unit column stride");
      a.block_table = table->data_ptr<int32_t>();
      a.bt_stride = table->stride(0);
      a.block_size = k.size(2);
    }
    const int64_t capacity = table ? table->size(1) * a.block_size : k.size(2);
    a.Lk = 0;  // the longest row (sizes the splits and the work estimate)
    if (const Tensor* starts = present(o.leftpad_k)) a.k_starts = int32_vector(*starts, a.B, "leftpad_k");
    for (int64_t b = 0; b < a.B; ++b) {
      TORCH_CHECK(a.k_lens[b] >= 0 && a.k_lens[b] <= capacity, "fastformer._C: seqlens_k[", b,
                  "] = ", a.k_lens[b], " is outside the cache's ", capacity, " rows");
      TORCH_CHECK(!a.k_starts || (a.k_starts[b] >= 0 && a.k_starts[b] <= a.k_lens[b]),
                  "fastformer._C: leftpad_k[", b, "] must be in [0, seqlens_k[", b, "]]");
      a.Lk = std::max<int64_t>(a.Lk, a.k_lens[b]);
    }
  } else {
    TORCH_CHECK(!present(o.block_table) && !present(o.leftpad_k),
                "fastformer._C: block_table and leftpad_k need seqlens_k");
  }
}

// The kernels' arguments of a call: sizes and views of q, k, v and every option (q, k, v as
// the kernels see them: heads_view).
inline cpu::AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v,
                               const AttentionOptions& o) {
  check_cpu(q, "attention");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->size(3) <= 1 || t->stride(3) == 1, "fastformer._C: last dim must be contiguous");
  cpu::AttnArgs a;
  a.dtype = to_dtype(q);
  a.B = q.size(0); a.H = q.size(1); a.Lq = q.size(2); a.D = q.size(3);
  a.Hkv = k.size(1); a.Lk = k.size(2); a.Dv = v.size(3);
  a.q = view4(q); a.k = view4(k); a.v = view4(v);
  if (const Tensor* m = present(o.attn_mask)) {
    a.attn_mask = view4(m->expand({a.B, a.H, a.Lq, a.Lk}));  // a view (stride 0 where it broadcasts)
    a.mask_is_bool = m->scalar_type() == at::kBool;
    if (!a.mask_is_bool) a.mask_dtype = to_dtype(*m);
  }
  if (const Tensor* kpm = present(o.key_padding_mask)) {
    a.key_padding_mask = kpm->data_ptr<bool>();
    a.kpm_s[0] = kpm->stride(0);
    a.kpm_s[1] = kpm->stride(1);
  }
  a.causal = static_cast<int32_t>(o.causal);
  a.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(a.D)));
  a.dropout_p = o.dropout_p;
  std::tie(a.seed, a.offset) = seed_offset(o.rng_state);
  a.window_left = o.window_left;
  a.window_right = o.window_right;
  a.softcap = o.softcap;
  const at::ScalarType acc = stats_dtype(q);
  if (const Tensor* s = present(o.alibi_slopes)) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && (s->dim() == 1 || s->dim() == 2),
                "fastformer._C: alibi_slopes must be fp32 (H,) or (B, H)");
    a.alibi_slopes = s->data_ptr<float>();
    a.alibi_s[0] = s->dim() == 2 ? s->stride(0) : 0;
    a.alibi_s[1] = s->stride(-1);
  }
  if (const Tensor* s = present(o.sinks)) {
    TORCH_CHECK(s->scalar_type() == acc && s->is_contiguous() && s->numel() == a.H,
                "fastformer._C: sinks must be (H,) contiguous in the accumulation dtype");
    a.sinks = s->data_ptr();
  }
  attn_lengths(a, k, o);
  if (const Tensor* s = present(o.alibi_slopes); s && a.cu_q)
    TORCH_CHECK(s->dim() == 1 || s->size(0) == a.n_seqs, "fastformer._C: alibi_slopes must be (H,) or (S, H)");
  return a;
}

// Columns of padding of the relative bias vector and its gradient (attention_common.h's
// kRelSlack: the kernels read whole vectors past a block's last key).
constexpr int64_t kRelSlack = 64;

// The relative bias of a call, (H, Lq + Lk - 1), copied into rows padded by kRelSlack zero
// columns (small: H * (Lq + Lk) values), or an undefined tensor. The kernels keep a pointer.
inline Tensor padded_rel_bias(const AttentionOptions& o, cpu::AttnArgs& a, const Tensor& q) {
  const Tensor* r = present(o.rel_bias);
  if (!r) return Tensor();
  TORCH_CHECK(r->scalar_type() == stats_dtype(q) && r->dim() == 2 && r->size(0) == a.H &&
                  r->size(1) == a.Lq + a.Lk - 1,
              "fastformer._C: rel_bias must be (H, Lq + Lk - 1) in the accumulation dtype");
  Tensor padded = at::zeros({a.H, a.Lq + a.Lk - 1 + kRelSlack}, r->options());
  padded.narrow(1, 0, a.Lq + a.Lk - 1).copy_(*r);
  a.rel_bias = padded.data_ptr();
  return padded;
}

// Returns {out, lse, out_residual}: (B, H, Lq, Dv), (B, H, Lq) and, for bf16 / fp16 with
// with_residual (calls a backward follows), the output's rounding residual in out's shape and
// layout (the backward's delta reads out + residual: cpu/attention_common.h, store_out_row),
// else an empty tensor; packed sequences (total_q, H, Dv) and (H, total_q).
inline std::vector<Tensor> attention_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const AttentionOptions& o, bool with_residual = true) {
  const Tensor q = heads_view(q_in, o), k = heads_view(k_in, o), v = heads_view(v_in, o);
  cpu::AttnArgs a = attn_args(q, k, v, o);
  const Tensor rel = padded_rel_bias(o, a, q);
  // (B, H, Lq, Dv) stored as (B, Lq, H, Dv): the head merge that follows is a free reshape.
  Tensor out = at::empty({a.B, a.Lq, a.H, a.Dv}, q.options()).transpose(1, 2);
  Tensor lse = at::empty({a.B, a.H, a.Lq}, q.options().dtype(stats_dtype(q)));
  const bool reduced = with_residual && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
  Tensor residual = reduced ? at::empty_like(out) : at::empty({0}, q.options());
  a.out = view4(out);
  if (reduced) a.out_residual = view4(residual);
  a.lse = lse.data_ptr();
  a.lse_s[0] = a.H * a.Lq;
  a.lse_s[1] = a.Lq;
  if (out.numel() > 0 || lse.numel() > 0) {
    if (a.Lk == 0) {
      out.zero_();
      if (reduced) residual.zero_();
      lse.fill_(std::numeric_limits<double>::infinity());
    } else {
      py::gil_scoped_release no_gil;
      cpu::kernels().attention_fwd(a);
    }
  }
  if (a.cu_q) return {out.transpose(1, 2)[0], lse[0], reduced ? residual.transpose(1, 2)[0] : residual};
  return {out, lse, residual};
}

// Returns {dq, dk, dv, d attn_mask, d sinks, d rel_bias}; the last three only when asked
// for (need_*), else undefined (None): the mask's gradient in its own shape and dtype (summed
// over the dims it broadcasts), the others in the accumulation dtype.
inline std::vector<Tensor> attention_bwd(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                         const Tensor& v_in, const Tensor& out_in, const Tensor& lse_in,
                                         const Tensor& out_residual_in, const AttentionOptions& o,
                                         bool need_dmask, bool need_dsinks, bool need_drel) {
  TORCH_CHECK(!present(o.seqlens_k), "fastformer._C: KV-cache calls are forward only");
  const Tensor q = heads_view(q_in, o), k = heads_view(k_in, o), v = heads_view(v_in, o);
  const Tensor dout = heads_view(dout_in, o), out = heads_view(out_in, o);
  const Tensor lse = present(o.cu_seqlens_q) ? lse_in.unsqueeze(0) : lse_in;  // (H, total_q)
  TORCH_CHECK(lse.is_contiguous(), "fastformer._C: lse must be contiguous");
  TORCH_CHECK(dout.size(3) <= 1 || dout.stride(3) == 1, "fastformer._C: dout last dim must be contiguous");
  cpu::AttnArgs a = attn_args(q, k, v, o);
  const Tensor rel = padded_rel_bias(o, a, q);
  Tensor dq_in = at::empty_like(q_in), dk_in = at::empty_like(k_in), dv_in = at::empty_like(v_in);
  Tensor dq = heads_view(dq_in, o), dk = heads_view(dk_in, o), dv = heads_view(dv_in, o);
  a.out = view4(out);
  if (out_residual_in.numel() > 0) {  // bf16 / fp16 forwards of this backend (attention_fwd)
    const Tensor residual = heads_view(out_residual_in, o);
    TORCH_CHECK(residual.sizes() == out.sizes() && residual.scalar_type() == out.scalar_type() &&
                    (residual.size(3) <= 1 || residual.stride(3) == 1),
                "fastformer._C: out_residual must be out's shape and dtype, last dim contiguous");
    a.out_residual = view4(residual);
  }
  a.lse = const_cast<void*>(lse.data_ptr());
  a.lse_s[0] = a.H * a.Lq;
  a.lse_s[1] = a.Lq;
  a.dout = view4(dout);
  a.dq = view4(dq); a.dk = view4(dk); a.dv = view4(dv);
  const auto acc = q.options().dtype(stats_dtype(q));
  Tensor dmask, dsinks, drel;
  const Tensor* mask = present(o.attn_mask);
  if (need_dmask && mask && mask->scalar_type() != at::kBool) {
    // Accumulated in the mask's own shape (left-padded to 4-D): stride 0 on the dims it
    // broadcasts, so that (B, H, Lq, Lk) indices add into it. A mask of the inputs' dtype that
    // broadcasts over no dim (a per-head bias, as DeBERTa's) gets one write per entry: it is
    // written in its dtype, without the fp32 buffer (twice the bytes to zero) and its
    // conversion ((4, 12, 512, 512) bf16, 2 Zen 5 cores: 9 ms zeroing, 3.5 ms converting).
    std::vector<int64_t> shape4(4 - mask->dim(), 1);
    for (int64_t s : mask->sizes()) shape4.push_back(s);
    a.dmask_in_dtype = mask->scalar_type() == q.scalar_type() &&
                       shape4 == std::vector<int64_t>{a.B, a.H, a.Lq, a.Lk};
    dmask = at::zeros(shape4, a.dmask_in_dtype ? q.options() : acc);
    for (int d = 0; d < 4; ++d) a.dmask_s[d] = shape4[d] == 1 ? 0 : dmask.stride(d);
    a.dmask = dmask.data_ptr();
  }
  if (need_dsinks && a.sinks) {  // parts per batch row (packed: per sequence), summed below
    dsinks = at::zeros({a.cu_q ? a.n_seqs : a.B, a.H}, acc);
    a.dsinks = dsinks.data_ptr();
  }
  if (need_drel && a.rel_bias) {
    drel = at::zeros({a.H, a.Lq + a.Lk - 1 + kRelSlack}, acc);
    a.drel = drel.data_ptr();
  }
  if (a.Lq == 0 || a.Lk == 0) {
    dq.zero_(); dk.zero_(); dv.zero_();
    if (dsinks.defined() && a.Lq > 0) {  // no key: p_sink = 1, d sink = -sum delta = 0 (out = 0)
      dsinks.zero_();
    }
  } else if (q.numel() + k.numel() > 0) {
    py::gil_scoped_release no_gil;
    cpu::kernels().attention_bwd(a);
  }
  if (dmask.defined()) dmask = dmask.to(mask->scalar_type()).reshape(mask->sizes());
  if (dsinks.defined()) dsinks = dsinks.sum(0);
  // Contiguous, as the op's fake promises (a narrowed view's row stride broke compiled T5
  // training: inductor asserts the strides); (H, Lq + Lk - 1) is small.
  if (drel.defined()) drel = drel.narrow(1, 0, a.Lq + a.Lk - 1).contiguous();
  return {dq_in, dk_in, dv_in, dmask, dsinks, drel};
}

}  // namespace cpu_bindings
}  // namespace fastformer
