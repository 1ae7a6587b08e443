// Python bindings of fastformer._C: turns tensors into the raw pointer/size/stride argument
// structs of the kernels, allocates outputs, releases the GIL, and calls the kernel table
// selected for the running CPU (or the CUDA launchers when built with CUDA).
//
// User-facing validation (ValueError/TypeError naming the argument) happens in Python
// (fastformer/_checks.py); the TORCH_CHECKs here guard the kernels' own preconditions, which the
// Python layer guarantees, so a failure here is a fastformer bug, not a user error.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <limits>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <optional>
#include <string>

#include "cpu/cpu_kernels.h"
#ifdef FASTFORMER_WITH_CUDA
#include "cuda/cuda_bindings.h"
#endif

namespace fastformer {
namespace {

namespace py = pybind11;
using at::Tensor;
using c10::optional;

// ---- CPU capability selection ---------------------------------------------------------------
enum Level { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
const char* kLevelNames[] = {"default", "avx2", "avx512"};

cpu::KernelTable make_table(Level level) {
  cpu::KernelTable t;
#define FF_FILL(LEVEL) \
  do {                 \
    FF_CPU_KERNELS(FF_FILL_ONE_##LEVEL) \
  } while (0)
#define FF_FILL_ONE_DEFAULT(name, Args) t.name = &cpu::DEFAULT::name;
#define FF_FILL_ONE_AVX2(name, Args) t.name = &cpu::AVX2::name;
#define FF_FILL_ONE_AVX512(name, Args) t.name = &cpu::AVX512::name;
  switch (level) {
#ifdef FF_HAVE_CAP_AVX512
    case kAvx512: FF_FILL(AVX512); break;
#endif
#ifdef FF_HAVE_CAP_AVX2
    case kAvx2: FF_FILL(AVX2); break;
#endif
    default: FF_FILL(DEFAULT); break;
  }
  return t;
}

Level max_supported_level() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
#ifdef FF_HAVE_CAP_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
#endif
#ifdef FF_HAVE_CAP_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
#endif
  return kDefault;
}

struct CpuState {
  Level level = kDefault;
  std::string note;  // why the level differs from the maximum, if it does
  cpu::KernelTable table;
};

CpuState& cpu_state() {
  static CpuState state = [] {
    CpuState s;
    s.level = max_supported_level();
    if (const char* env = std::getenv("FASTFORMER_CPU_ARCH")) {
      std::string want(env);
      int idx = -1;
      for (int i = 0; i < 3; ++i)
        if (want == kLevelNames[i]) idx = i;
      if (idx < 0) {
        s.note = "FASTFORMER_CPU_ARCH=" + want + " is not one of default|avx2|avx512; ignored";
      } else if (idx > s.level) {
        s.note = "FASTFORMER_CPU_ARCH=" + want + " is not supported by this CPU/build; using " +
                 kLevelNames[s.level];
      } else {
        s.level = static_cast<Level>(idx);
        s.note = "capped by FASTFORMER_CPU_ARCH=" + want;
      }
    }
    s.table = make_table(s.level);
    return s;
  }();
  return state;
}

const cpu::KernelTable& kernels() { return cpu_state().table; }

void set_cpu_capability(const std::string& name) {
  for (int i = 0; i <= max_supported_level(); ++i) {
    if (name == kLevelNames[i]) {
      cpu_state().level = static_cast<Level>(i);
      cpu_state().table = make_table(static_cast<Level>(i));
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "set_cpu_capability: '", name, "' is not supported here (max '",
                    kLevelNames[max_supported_level()], "')");
}

// ---- AMX -------------------------------------------------------------------------------------
// AMX needs the CPU's AMX-TILE / AMX-BF16 (CPUID leaf 7: EDX bits 24 / 22), an OS that enables
// the tile state in XCR0 (bits 17, 18) and, on Linux, a per-process request for the tile data
// state (ARCH_REQ_XCOMP_PERM), which is also what torch's oneDNN makes before its AMX GEMMs.
struct AmxState {
  bool supported = false;  // the CPU and OS can run AMX-BF16 in this process
  bool enabled = false;    // the kernels use it (supported, and not turned off)
  std::string note;        // why it is off, if it is
};

bool probe_amx(std::string& why) {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) {
    why = "the CPU has no AMX-BF16";
    return false;
  }
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) {  // OSXSAVE
    why = "the OS does not enable XSAVE";
    return false;
  }
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) {
    why = "the OS does not enable the AMX tile state";
    return false;
  }
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    why = "the kernel refused the AMX tile data permission";
    return false;
  }
  return true;
#else
  why = "AMX is used on x86-64 Linux only";
  return false;
#endif
}

AmxState& amx_state() {
  static AmxState state = [] {
    AmxState s;
    s.supported = probe_amx(s.note);
    s.enabled = s.supported;
    const char* env = std::getenv("FASTFORMER_CPU_AMX");
    if (s.enabled && env && std::string(env) == "0") {
      s.enabled = false;
      s.note = "turned off by FASTFORMER_CPU_AMX=0";
    }
    return s;
  }();
  return state;
}

void set_cpu_amx(bool enable) {
  AmxState& s = amx_state();
  TORCH_CHECK_VALUE(!enable || s.supported, "set_cpu_amx: AMX-BF16 is not usable here (", s.note, ")");
  s.enabled = enable;
  s.note = enable ? "" : "turned off by set_cpu_amx(False)";
}

// The kernels selected now run bf16 on AMX: the avx512 level (the only one with AMX code) and
// AMX usable and on.
bool amx_in_use() { return cpu_state().level == kAvx512 && amx_state().enabled; }

py::dict cpu_info() {
  py::dict d;
  d["capability"] = kLevelNames[cpu_state().level];
  d["max_capability"] = kLevelNames[max_supported_level()];
  d["note"] = cpu_state().note;
  py::list built;
  built.append("default");
#ifdef FF_HAVE_CAP_AVX2
  built.append("avx2");
#endif
#ifdef FF_HAVE_CAP_AVX512
  built.append("avx512");
#endif
  d["built"] = built;
  // Used by the avx512 level's bf16 attention score GEMMs (csrc/cpu/amx_bf16.h).
  d["amx_bf16"] = amx_state().enabled;  // the switch (set_cpu_amx); in use: amx_in_use()
  d["amx_in_use"] = amx_in_use();
  d["amx_note"] = amx_state().note;
#ifdef FASTFORMER_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  return d;
}

// ---- tensor -> kernel argument helpers ------------------------------------------------------
DType to_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "fastformer._C: unsupported dtype ", t.scalar_type());
  }
}

// Rows of a tensor viewed as (rows, last_dim): coalesce leading dims where possible. Any
// strides (row_layout() below requires a contiguous last dim).
cpu::RowLayout leading_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "fastformer._C: expected at least one dimension");
  cpu::RowLayout layout;
  int64_t sizes[64], strides[64];
  int n = 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 1) continue;  // size-1 dims never move the pointer
    if (n > 0 && strides[n - 1] == t.stride(d) * t.size(d)) {
      sizes[n - 1] *= t.size(d);
      strides[n - 1] = t.stride(d);
    } else {
      sizes[n] = t.size(d);
      strides[n] = t.stride(d);
      ++n;
    }
  }
  if (n == 0) {
    layout.ndim = 1;
    layout.sizes[0] = 1;
    layout.strides[0] = 0;
    return layout;
  }
  TORCH_CHECK(n <= cpu::kMaxDims, "fastformer._C: too many non-mergeable leading dims");
  layout.ndim = n;
  for (int i = 0; i < n; ++i) {
    layout.sizes[i] = sizes[i];
    layout.strides[i] = strides[i];
  }
  return layout;
}

cpu::RowLayout row_layout(const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1 && (t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0),
              "fastformer._C: last dimension must be contiguous");
  return leading_layout(t);
}

const void* ptr_or_null(const optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

at::ScalarType stats_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Releases the GIL around a kernel when this thread holds it: a call from Python does, the
// autograd engine running a C++ node's backward (AddNormFunction) does not.
class KernelGilRelease {
 public:
  KernelGilRelease() {
    if (PyGILState_Check()) release_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

// ---- add + norm -----------------------------------------------------------------------------
std::vector<Tensor> add_norm_fwd(const Tensor& x, const optional<Tensor>& residual,
                                 const optional<Tensor>& weight, const optional<Tensor>& bias,
                                 double eps, bool rms, bool return_residual) {
#ifdef FASTFORMER_WITH_CUDA
  if (x.is_cuda()) return cuda::add_norm_fwd(x, residual, weight, bias, eps, rms, return_residual);
#endif
  TORCH_CHECK(x.device().is_cpu(), "fastformer._C.add_norm_fwd: expected CPU tensors");
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const bool has_res = residual.has_value() && residual->defined();
  Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor res_out = (return_residual && has_res) ? at::empty_like(y) : at::empty({0}, x.options());
  auto stat_opts = x.options().dtype(stats_dtype(x));
  Tensor mean = rms ? at::empty({0}, stat_opts) : at::empty({rows}, stat_opts);
  Tensor rstd = at::empty({rows}, stat_opts);

  cpu::NormFwdArgs a;
  a.dtype = to_dtype(x);
  a.param_dtype = weight.has_value() ? to_dtype(*weight) : (bias.has_value() ? to_dtype(*bias) : a.dtype);
  a.rows = rows;
  a.hidden = hidden;
  a.eps = eps;
  a.rms = rms;
  a.x = x.data_ptr();
  a.x_rows = row_layout(x);
  if (has_res) {
    a.residual = residual->data_ptr();
    a.residual_rows = row_layout(*residual);
  }
  a.weight = ptr_or_null(weight);
  a.bias = ptr_or_null(bias);
  a.y = y.data_ptr();
  a.residual_out = res_out.numel() ? res_out.data_ptr() : nullptr;
  a.mean = rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  if (rows > 0) {
    KernelGilRelease no_gil;
    kernels().add_norm_fwd(a);
  }
  return {y, res_out, mean, rstd};
}

std::vector<Tensor> add_norm_bwd(const Tensor& dy, const optional<Tensor>& dresidual_out,
                                 const Tensor& z_a, const optional<Tensor>& z_b,
                                 const optional<Tensor>& weight, const Tensor& mean,
                                 const Tensor& rstd, bool rms, bool need_dweight, bool need_dbias,
                                 int64_t param_dtype_code) {
#ifdef FASTFORMER_WITH_CUDA
  if (dy.is_cuda())
    return cuda::add_norm_bwd(dy, dresidual_out, z_a, z_b, weight, mean, rstd, rms, need_dweight,
                              need_dbias, param_dtype_code);
#endif
  TORCH_CHECK(dy.device().is_cpu(), "fastformer._C.add_norm_bwd: expected CPU tensors");
  const int64_t hidden = z_a.size(-1);
  const int64_t rows = hidden == 0 ? 0 : z_a.numel() / hidden;
  const DType param_dtype = static_cast<DType>(param_dtype_code);
  const at::ScalarType param_st = param_dtype == DType::f32   ? at::kFloat
                                  : param_dtype == DType::f64 ? at::kDouble
                                  : param_dtype == DType::bf16 ? at::kBFloat16
                                                               : at::kHalf;
  Tensor dz = at::empty(z_a.sizes(), z_a.options().memory_format(at::MemoryFormat::Contiguous));
  auto p_opts = z_a.options().dtype(param_st);
  Tensor dweight = need_dweight ? at::empty({hidden}, p_opts) : at::empty({0}, p_opts);
  Tensor dbias = need_dbias ? at::empty({hidden}, p_opts) : at::empty({0}, p_opts);

  cpu::NormBwdArgs a;
  a.dtype = to_dtype(z_a);
  a.param_dtype = param_dtype;
  a.rows = rows;
  a.hidden = hidden;
  a.rms = rms;
  a.dy = dy.data_ptr();
  a.dy_rows = row_layout(dy);
  if (dresidual_out.has_value() && dresidual_out->defined()) {
    a.dresidual_out = dresidual_out->data_ptr();
    a.dresidual_out_rows = row_layout(*dresidual_out);
  }
  a.z_a = z_a.data_ptr();
  a.z_a_rows = row_layout(z_a);
  if (z_b.has_value() && z_b->defined()) {
    a.z_b = z_b->data_ptr();
    a.z_b_rows = row_layout(*z_b);
  }
  a.weight = ptr_or_null(weight);
  a.mean = rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  a.dz = dz.data_ptr();
  a.dweight = need_dweight ? dweight.data_ptr() : nullptr;
  a.dbias = need_dbias ? dbias.data_ptr() : nullptr;
  {
    KernelGilRelease no_gil;
    kernels().add_norm_bwd(a);
  }
  return {dz, dweight, dbias};
}

// A gradient with a contiguous last dim (autograd may hand over an expanded, stride-0 one).
Tensor rowwise(const Tensor& t) {
  if (!t.defined() || t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1) return t;
  return t.contiguous();
}

optional<Tensor> defined_or_none(const Tensor& t) {
  return t.defined() ? optional<Tensor>(t) : c10::nullopt;
}

// add + norm as a C++ autograd node: the eager route of ff.add_layer_norm / layer_norm /
// rms_norm on the compiled backends (ops/norm.py). Same saved tensors, kernels and gradients as
// the Python autograd.Function there (which the reference and Triton backends keep using);
// what it removes is that Function's per-call Python cost, ~0.1-0.2 ms per forward+backward on
// the 2-core VM: as much as the kernels themselves at (512, 768).
struct AddNormFunction : public torch::autograd::Function<AddNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, Tensor x,
                                                optional<Tensor> residual, optional<Tensor> weight,
                                                optional<Tensor> bias, double eps, bool rms,
                                                bool return_residual) {
    std::vector<Tensor> out = add_norm_fwd(x, residual, weight, bias, eps, rms, return_residual);
    const bool has_res = residual.has_value() && residual->defined();
    const bool keeps_res_out = has_res && return_residual;
    // z = x + residual is recomputed from what the caller keeps anyway: the returned residual
    // stream, else x and residual.
    const Tensor z_a = keeps_res_out ? out[1] : x;
    const Tensor z_b = (has_res && !keeps_res_out) ? *residual : Tensor();
    const Tensor w = weight.has_value() ? *weight : Tensor();
    ctx->save_for_backward({z_a, z_b, w, out[2], out[3]});
    const bool has_bias = bias.has_value() && bias->defined();
    const Tensor& params = w.defined() ? w : (has_bias ? *bias : x);
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["has_res"] = has_res;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["keeps_res_out"] = keeps_res_out;
    ctx->saved_data["param_dtype"] = static_cast<int64_t>(to_dtype(params));
    return {out[0], out[1]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &z_a = saved[0], &z_b = saved[1], &weight = saved[2];
    const bool has_res = ctx->saved_data["has_res"].toBool();
    // needs_input_grad counts tensor inputs only (absent optional ones have no edge).
    const int64_t weight_edge = has_res ? 2 : 1;
    const int64_t bias_edge = weight_edge + (weight.defined() ? 1 : 0);
    const bool need_dw = weight.defined() && ctx->needs_input_grad(weight_edge);
    const bool need_db = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(bias_edge);
    Tensor dres_out = grads[1];
    if (dres_out.defined() && (!ctx->saved_data["keeps_res_out"].toBool() || dres_out.numel() == 0))
      dres_out = Tensor();
    std::vector<Tensor> g = add_norm_bwd(
        rowwise(grads[0]), defined_or_none(rowwise(dres_out)), z_a, defined_or_none(z_b),
        defined_or_none(weight), saved[3], saved[4], ctx->saved_data["rms"].toBool(), need_dw,
        need_db, ctx->saved_data["param_dtype"].toInt());
    return {g[0], has_res ? g[0] : Tensor(), need_dw ? g[1] : Tensor(),
            need_db ? g[2] : Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::vector<Tensor> add_norm_autograd(const Tensor& x, const optional<Tensor>& residual,
                                      const optional<Tensor>& weight,
                                      const optional<Tensor>& bias, double eps, bool rms,
                                      bool return_residual) {
  return AddNormFunction::apply(x, residual, weight, bias, eps, rms, return_residual);
}

// ---- attention --------------------------------------------------------------------------------
cpu::View4 view4(const Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "fastformer._C: expected a 4-D tensor");
  cpu::View4 v;
  v.ptr = t.data_ptr();
  for (int i = 0; i < 4; ++i) v.s[i] = t.stride(i);
  return v;
}

cpu::AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v,
                        const optional<Tensor>& attn_mask, const optional<Tensor>& key_padding_mask,
                        int64_t causal, double scale, double dropout_p, int64_t seed, int64_t offset) {
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->size(3) <= 1 || t->stride(3) == 1, "fastformer._C: last dim must be contiguous");
  cpu::AttnArgs a;
  a.dtype = to_dtype(q);
  a.B = q.size(0); a.H = q.size(1); a.Lq = q.size(2); a.D = q.size(3);
  a.Hkv = k.size(1); a.Lk = k.size(2); a.Dv = v.size(3);
  a.q = view4(q); a.k = view4(k); a.v = view4(v);
  if (attn_mask.has_value() && attn_mask->defined()) {
    a.attn_mask = view4(*attn_mask);
    a.mask_is_bool = attn_mask->scalar_type() == at::kBool;
    if (!a.mask_is_bool) a.mask_dtype = to_dtype(*attn_mask);
  }
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    a.key_padding_mask = key_padding_mask->data_ptr<bool>();
    a.kpm_s[0] = key_padding_mask->stride(0);
    a.kpm_s[1] = key_padding_mask->stride(1);
  }
  a.causal = static_cast<int32_t>(causal);
  a.scale = scale;
  a.dropout_p = dropout_p;
  a.seed = static_cast<uint64_t>(seed);
  a.offset = static_cast<uint64_t>(offset);
  return a;
}

std::vector<Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const optional<Tensor>& attn_mask,
                                  const optional<Tensor>& key_padding_mask, int64_t causal,
                                  double scale, double dropout_p, int64_t seed, int64_t offset) {
#ifdef FASTFORMER_WITH_CUDA
  if (q.is_cuda())
    return cuda::attention_fwd(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                               seed, offset);
#endif
  TORCH_CHECK(q.device().is_cpu(), "fastformer._C.attention_fwd: expected CPU tensors");
  cpu::AttnArgs a = attn_args(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                              seed, offset);
  // (B, H, Lq, Dv) stored as (B, Lq, H, Dv): the head merge that follows is a free reshape.
  Tensor out = at::empty({a.B, a.Lq, a.H, a.Dv}, q.options()).transpose(1, 2);
  Tensor lse = at::empty({a.B, a.H, a.Lq}, q.options().dtype(stats_dtype(q)));
  a.out = view4(out);
  a.lse = lse.data_ptr();
  if (out.numel() > 0 || lse.numel() > 0) {
    if (a.Lk == 0) {
      out.zero_();
      lse.fill_(std::numeric_limits<double>::infinity());
    } else {
      py::gil_scoped_release no_gil;
      kernels().attention_fwd(a);
    }
  }
  return {out, lse};
}

std::vector<Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const optional<Tensor>& attn_mask,
                                  const optional<Tensor>& key_padding_mask, int64_t causal,
                                  double scale, double dropout_p, int64_t seed, int64_t offset) {
#ifdef FASTFORMER_WITH_CUDA
  if (q.is_cuda())
    return cuda::attention_bwd(dout, q, k, v, out, lse, attn_mask, key_padding_mask, causal, scale,
                               dropout_p, seed, offset);
#endif
  TORCH_CHECK(q.device().is_cpu(), "fastformer._C.attention_bwd: expected CPU tensors");
  TORCH_CHECK(dout.size(3) <= 1 || dout.stride(3) == 1, "fastformer._C: dout last dim must be contiguous");
  cpu::AttnArgs a = attn_args(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                              seed, offset);
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  a.out = view4(out);
  a.lse = const_cast<void*>(lse.data_ptr());
  a.dout = view4(dout);
  a.dq = view4(dq); a.dk = view4(dk); a.dv = view4(dv);
  if (a.Lq == 0 || a.Lk == 0) {
    dq.zero_(); dk.zero_(); dv.zero_();
  } else if (q.numel() + k.numel() > 0) {
    py::gil_scoped_release no_gil;
    kernels().attention_bwd(a);
  }
  return {dq, dk, dv};
}

// ---- rotary position embedding ----------------------------------------------------------------
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, bool conj) {
  TORCH_CHECK(x.device().is_cpu(), "fastformer._C.rotary: expected CPU tensors (no CUDA kernel; "
              "CUDA tensors run the Triton one)");
  TORCH_CHECK(x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1),
              "fastformer._C.rotary: x must be 4-D with a contiguous last dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(0) == x.size(2) && 2 * cos.size(1) <= x.size(3) &&
                  cos.scalar_type() == stats_dtype(x) && sin.scalar_type() == stats_dtype(x),
              "fastformer._C.rotary: cos and sin must be contiguous (L, R/2) tables in the "
              "accumulation dtype");
  cpu::RotaryArgs a;
  a.dtype = to_dtype(x);
  a.B = x.size(0); a.H = x.size(1); a.L = x.size(2); a.D = x.size(3);
  a.rot_dim = 2 * cos.size(1);
  // (B, H, L, D) stored as (B, L, H, D), the layout of the projection the heads come from.
  Tensor out = at::empty({a.B, a.L, a.H, a.D}, x.options()).transpose(1, 2);
  a.x = view4(x);
  a.out = view4(out);
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.interleaved = interleaved;
  a.conj = conj;
  if (out.numel() > 0) {
    py::gil_scoped_release no_gil;
    kernels().rotary(a);
  }
  return out;
}

// ---- feed-forward ---------------------------------------------------------------------------
// (..., cols) tensor as a matrix: rows by leading_layout, any column stride.
cpu::MatView matrix_view(const Tensor& t) {
  cpu::MatView v;
  v.ptr = t.data_ptr();
  v.rows = leading_layout(t);
  v.col_stride = t.size(-1) <= 1 ? 1 : t.stride(-1);
  return v;
}

cpu::FfnArgs ffn_args(const Tensor& x, const Tensor& w1, const Tensor& w2,
                      const optional<Tensor>& w_up, int64_t activation, double dropout_p,
                      int64_t seed, int64_t offset) {
  TORCH_CHECK(x.device().is_cpu(), "fastformer._C ffn: expected CPU tensors");
  TORCH_CHECK(activation >= 0 && activation <= 3, "fastformer._C ffn: activation code must be 0..3");
  cpu::FfnArgs a;
  a.dtype = to_dtype(x);
  a.activation = static_cast<int32_t>(activation);
  a.gated = w_up.has_value() && w_up->defined();
  a.d_model = x.size(-1);
  a.tokens = a.d_model == 0 ? 0 : x.numel() / a.d_model;
  a.hidden = w1.size(0);
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == a.d_model && w2.dim() == 2 &&
              w2.size(0) == a.d_model && w2.size(1) == a.hidden,
              "fastformer._C ffn: weight shapes do not match");
  a.dropout_p = dropout_p;
  a.seed = static_cast<uint64_t>(seed);
  a.offset = static_cast<uint64_t>(offset);
  a.x = matrix_view(x);
  a.w1 = matrix_view(w1);
  a.w2 = matrix_view(w2);
  if (a.gated) a.w_up = matrix_view(*w_up);
  return a;
}

// Returns {y, saved}: saved is the pre-activation (tokens, hidden) (gated: (tokens, 2 * hidden)
// as [gate | up]) when save_preactivation, else empty.
std::vector<Tensor> ffn_fwd(const Tensor& x, const Tensor& w1, const optional<Tensor>& b1,
                            const Tensor& w2, const optional<Tensor>& b2,
                            const optional<Tensor>& w_up, const optional<Tensor>& b_up,
                            int64_t activation, double dropout_p, int64_t seed, int64_t offset,
                            bool save_preactivation) {
  cpu::FfnArgs a = ffn_args(x, w1, w2, w_up, activation, dropout_p, seed, offset);
  a.b1 = ptr_or_null(b1);
  a.b2 = ptr_or_null(b2);
  a.b_up = a.gated ? ptr_or_null(b_up) : nullptr;
  Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t width = a.gated && save_preactivation ? 2 * a.hidden : a.hidden;
  Tensor hidden = at::empty({a.tokens, width}, x.options());
  a.y = y.data_ptr();
  a.hidden_buf = hidden.data_ptr();
  a.store_preactivation = save_preactivation;
  if (a.tokens > 0) {
    py::gil_scoped_release no_gil;
    kernels().ffn_fwd(a);
  }
  return {y, save_preactivation ? hidden : at::empty({0}, x.options())};
}

// Returns {dx, dw1, db1, dw2, db2, dw_up, db_up}; those not asked for are empty.
std::vector<Tensor> ffn_bwd(const Tensor& dy, const Tensor& x, const Tensor& w1, const Tensor& w2,
                            const optional<Tensor>& w_up, const Tensor& saved, int64_t activation,
                            double dropout_p, int64_t seed, int64_t offset, bool need_dx,
                            bool need_dw1, bool need_db1, bool need_dw2, bool need_db2,
                            bool need_dw_up, bool need_db_up) {
  cpu::FfnArgs a = ffn_args(x, w1, w2, w_up, activation, dropout_p, seed, offset);
  TORCH_CHECK(dy.sizes() == x.sizes(), "fastformer._C.ffn_bwd: dy must have x's shape");
  TORCH_CHECK(saved.is_contiguous() && saved.numel() == a.tokens * a.hidden * (a.gated ? 2 : 1),
              "fastformer._C.ffn_bwd: saved must be the forward's contiguous pre-activation");
  const auto opts = x.options();
  auto maybe = [&](bool need, at::IntArrayRef shape) {
    return need ? at::empty(shape, opts) : at::empty({0}, opts);
  };
  const int64_t D = a.d_model, F = a.hidden;
  Tensor dx = need_dx ? at::empty(x.sizes(), opts.memory_format(at::MemoryFormat::Contiguous))
                      : at::empty({0}, opts);
  Tensor dw1 = maybe(need_dw1, {F, D}), db1 = maybe(need_db1, {F});
  Tensor dw2 = maybe(need_dw2, {D, F}), db2 = maybe(need_db2, {D});
  Tensor dw_up = maybe(a.gated && need_dw_up, {F, D}), db_up = maybe(a.gated && need_db_up, {F});
  const bool need_hidden = need_dx || need_dw1 || need_db1 || (a.gated && (need_dw_up || need_db_up));
  Tensor d_hidden = maybe(need_hidden, {a.tokens, a.gated ? 2 * F : F});
  a.dy = matrix_view(dy);
  a.saved = saved.data_ptr();
  a.d_hidden = need_hidden ? d_hidden.data_ptr() : nullptr;
  auto ptr = [](bool need, Tensor& t) { return need ? t.data_ptr() : nullptr; };
  a.dx = ptr(need_dx, dx);
  a.dw1 = ptr(need_dw1, dw1);
  a.db1 = ptr(need_db1, db1);
  a.dw2 = ptr(need_dw2, dw2);
  a.db2 = ptr(need_db2, db2);
  a.dw_up = ptr(a.gated && need_dw_up, dw_up);
  a.db_up = ptr(a.gated && need_db_up, db_up);
  {
    py::gil_scoped_release no_gil;
    kernels().ffn_bwd(a);
  }
  return {dx, dw1, db1, dw2, db2, dw_up, db_up};
}

}  // namespace

namespace cpu {
bool amx_bf16_enabled() { return amx_state().enabled; }
}  // namespace cpu
}  // namespace fastformer

PYBIND11_MODULE(_C, m) {
  using namespace fastformer;
  m.doc() = "fastformer compiled kernels (CPU; CUDA when built with it)";
  m.def("cpu_info", &cpu_info, "CPU capability levels built, selected and supported");
  m.def("set_cpu_capability", &set_cpu_capability, "Select default|avx2|avx512 kernels (tests)");
  m.def("set_cpu_amx", &set_cpu_amx, "Use AMX-BF16 at the avx512 level where supported (tests)");
  m.def("use_amx_bf16", &amx_in_use,
        "Whether bf16 runs on AMX tiles now (the avx512 kernels selected, AMX-BF16 usable and on)");
  m.def("add_norm_fwd", &add_norm_fwd);
  m.def("add_norm_bwd", &add_norm_bwd);
  m.def("add_norm_autograd", &add_norm_autograd, "add + norm with a C++ autograd node: [y, res_out]");
  m.def("attention_fwd", &attention_fwd);
  m.def("attention_bwd", &attention_bwd);
  m.def("rotary", &rotary);
  m.def("ffn_fwd", &ffn_fwd);
  m.def("ffn_bwd", &ffn_bwd);
#ifdef FASTFORMER_WITH_CUDA
  m.def("ffn_bias_act_fwd", &cuda::ffn_bias_act_fwd, "y = act(x + bias), CUDA");
  m.def("ffn_bias_act_bwd", &cuda::ffn_bias_act_bwd, "{dx, dbias}, CUDA");
  m.def("ffn_gated_act_fwd", &cuda::ffn_gated_act_fwd, "h = act(gate) * up, CUDA");
  m.def("ffn_gated_act_bwd", &cuda::ffn_gated_act_bwd, "{dgate, dup}, CUDA");
#endif
}
