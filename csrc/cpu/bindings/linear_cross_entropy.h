// CPU bindings: the fused LM-head cross-entropy's row pass and pair add.
#pragma once
#include "cpu/bindings/common.h"

namespace fastformer {
namespace cpu_bindings {

// The row pass over one chunk of logits (the chunk loop and its GEMMs run in
// fastformer/reference/linear_cross_entropy.py): loss and lse per row (compute_loss), and / or
// the logits overwritten by their gradient times grad_scale (and row_scale) (write_grad), whose
// column sums are added to dbias (f64) when given.
inline void lce_rows(const Tensor& logits, const Tensor& target, const Tensor& loss,
                     const Tensor& lse, const optional<Tensor>& row_scale,
                     const optional<Tensor>& dbias, const LinearCrossEntropyOptions& o,
                     double grad_scale, bool compute_loss, bool write_grad) {
  check_cpu(logits, "lce_rows");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "fastformer._C.lce_rows: logits must be a contiguous (rows, vocab) matrix");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::ScalarType acc = stats_dtype(logits);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == rows,
              "fastformer._C.lce_rows: target must be a contiguous int64 vector of the rows");
  for (const Tensor* t : {&loss, &lse})
    TORCH_CHECK(t->scalar_type() == acc && t->is_contiguous() && t->numel() == rows,
                "fastformer._C.lce_rows: loss and lse must be contiguous (rows,) in the "
                "accumulation dtype");
  const Tensor* rs = present(row_scale);
  TORCH_CHECK(!rs || (rs->scalar_type() == acc && rs->is_contiguous() && rs->numel() == rows),
              "fastformer._C.lce_rows: row_scale must be contiguous (rows,) in the accumulation "
              "dtype");
  const Tensor* db = present(dbias);
  TORCH_CHECK(!db || (db->scalar_type() == at::kDouble && db->is_contiguous() &&
                      db->numel() == vocab),
              "fastformer._C.lce_rows: dbias must be a contiguous float64 (vocab,) vector");
  cpu::LceRowsArgs a;
  a.dtype = to_dtype(logits);
  a.rows = rows;
  a.vocab = vocab;
  a.logits = logits.data_ptr();
  a.target = target.data_ptr<int64_t>();
  a.ignore_index = o.ignore_index;
  a.label_smoothing = o.label_smoothing;
  a.softcap = o.softcap;
  a.compute_loss = compute_loss;
  a.loss = loss.data_ptr();
  a.lse = lse.data_ptr();
  a.write_grad = write_grad;
  a.grad_scale = grad_scale;
  a.row_scale = rs ? rs->data_ptr() : nullptr;
  a.dbias = db ? db->data_ptr() : nullptr;
  if (rows > 0 && vocab > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().lce_rows(a);
  }
}

// hi + lo += p in place (compensated accumulation in a pair of buffers of p's dtype); lo is
// not read when read_lo is false (taken as 0) and not written when write_lo is false, and may
// then be None.
inline void lce_pair_add(const Tensor& hi, const optional<Tensor>& lo, const Tensor& p, bool read_lo,
                         bool write_lo) {
  check_cpu(hi, "lce_pair_add");
  const bool uses_lo = read_lo || write_lo;
  TORCH_CHECK(!uses_lo || present(lo), "fastformer._C.lce_pair_add: lo is read or written, but None");
  for (const Tensor* t : {&hi, uses_lo ? &*lo : &hi, &p})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == p.scalar_type() &&
                    t->numel() == p.numel(),
                "fastformer._C.lce_pair_add: hi, lo and p must be contiguous, of one dtype and size");
  cpu::PairAddArgs a;
  a.dtype = to_dtype(p);
  a.n = p.numel();
  a.hi = hi.data_ptr();
  a.lo = uses_lo ? lo->data_ptr() : nullptr;
  a.p = p.data_ptr();
  a.read_lo = read_lo;
  a.write_lo = write_lo;
  if (a.n > 0) {
    KernelGilRelease no_gil;
    cpu::kernels().lce_pair_add(a);
  }
}

}  // namespace cpu_bindings
}  // namespace fastformer
