// Python bindings of fastformer._C: the CPU capability level and AMX state, and the module's
// functions. The tensor glue lives beside each backend's kernels: csrc/cpu/cpu_bindings.h (CPU
// tensors, one op family per file under csrc/cpu/bindings/) and csrc/cuda/cuda_bindings.h (CUDA
// tensors, the cuda_* functions, only when built with CUDA). Each function takes one backend's tensors: the Python selection
// (fastformer/backends.py) has decided the backend, nothing here dispatches on device again.
// Options arrive as the structs of csrc/options.h, filled from the Python option objects.
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <string>
#include <utility>

#include "cpu/cpu_bindings.h"
#include "options.h"
#ifdef FASTFORMER_WITH_CUDA
#include "cuda/cuda_bindings.h"
#endif

namespace fastformer {
namespace {

namespace py = pybind11;

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

// An instruction set extension the avx512 kernels may use (AMX-BF16, AVX512-BF16).
struct FeatureState {
  bool supported = false;  // the CPU and OS can run it in this process
  bool enabled = false;    // the kernels use it (supported, and not turned off)
  std::string note;        // why it is off, if it is

  // supported as probed (note: why not), then off where environment variable `env` is "0".
  FeatureState(bool can_run, std::string why_not, const char* env)
      : supported(can_run), enabled(can_run), note(can_run ? "" : std::move(why_not)) {
    const char* value = std::getenv(env);
    if (enabled && value && std::string(value) == "0") {
      enabled = false;
      note = std::string("turned off by ") + env + "=0";
    }
  }
  // The tests' switch (`fn`: the binding's name): on only where supported.
  void set(bool enable, const char* fn, const char* what) {
    TORCH_CHECK_VALUE(!enable || supported, fn, ": ", what, " is not usable here (", note, ")");
    if (!supported) return;  // off already, and the note says why
    enabled = enable;
    note = enable ? "" : std::string("turned off by ") + fn + "(False)";
  }
};

// ---- AMX -------------------------------------------------------------------------------------
// AMX needs the CPU's AMX-TILE / AMX-BF16 (CPUID leaf 7: EDX bits 24 / 22), an OS that enables
// the tile state in XCR0 (bits 17, 18) and, on Linux, a per-process request for the tile data
// state (ARCH_REQ_XCOMP_PERM), which is also what torch's oneDNN makes before its AMX GEMMs.
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

FeatureState& amx_state() {
  static FeatureState state = [] {
    std::string why;
    const bool ok = probe_amx(why);
    return FeatureState(ok, why, "FASTFORMER_CPU_AMX");
  }();
  return state;
}

void set_cpu_amx(bool enable) { amx_state().set(enable, "set_cpu_amx", "AMX-BF16"); }

// ---- AVX512-BF16 -----------------------------------------------------------------------------
// VDPBF16PS (CPUID leaf 7 subleaf 1: EAX bit 5), for the bf16 attention GEMMs where AMX is not
// used; its zmm state is the AVX-512 level's own (that level's selection checked the OS).
FeatureState& avx512_bf16_state() {
  static FeatureState state = [] {
#if defined(__x86_64__)
    unsigned eax = 0, ebx, ecx, edx;
    const bool ok = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
    return FeatureState(ok, "the CPU has no AVX512-BF16", "FASTFORMER_CPU_AVX512_BF16");
#else
    return FeatureState(false, "AVX512-BF16 is x86-64 only", "FASTFORMER_CPU_AVX512_BF16");
#endif
  }();
  return state;
}

void set_cpu_avx512_bf16(bool enable) { avx512_bf16_state().set(enable, "set_cpu_avx512_bf16", "AVX512-BF16"); }

// The kernels selected now run bf16 on AMX: the avx512 level (the only one with AMX code) and
// AMX usable and on.
bool amx_in_use() { return cpu_state().level == kAvx512 && amx_state().enabled; }

// CPUID's vendor string ("GenuineIntel", "AuthenticAMD", ...); empty off x86-64. The FFN's fp32
// route depends on it (fastformer/ops/ffn.py: torch's MKL GEMMs run at the FMA peak on Intel
// CPUs only).
std::string cpu_vendor() {
#if defined(__x86_64__)
  unsigned eax, regs[3];
  if (!__get_cpuid(0, &eax, &regs[0], &regs[2], &regs[1])) return "";  // EBX, EDX, ECX
  return std::string(reinterpret_cast<const char*>(regs), sizeof(regs));
#else
  return "";
#endif
}

py::dict cpu_info() {
  py::dict d;
  d["vendor"] = cpu_vendor();
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
  // Used by the avx512 level's bf16 attention GEMMs (csrc/cpu/bf16_gemm.h).
  d["amx_bf16"] = amx_state().enabled;  // the switch (set_cpu_amx); in use: amx_in_use()
  d["amx_in_use"] = amx_in_use();
  d["amx_note"] = amx_state().note;
  d["avx512_bf16"] = avx512_bf16_state().enabled;  // the switch (set_cpu_avx512_bf16)
  d["avx512_bf16_note"] = avx512_bf16_state().note;
  constexpr const char* kBf16GemmNames[] = {"fp32", "avx512_bf16", "amx"};
  d["bf16_attention_gemm"] = kBf16GemmNames[static_cast<int>(cpu::bf16_gemm_mode())];
#ifdef FASTFORMER_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  return d;
}

}  // namespace

namespace cpu {
Bf16Gemm bf16_gemm_mode() {
  if (cpu_state().level != kAvx512) return Bf16Gemm::kFp32;
  if (amx_state().enabled) return Bf16Gemm::kAmx;
  return avx512_bf16_state().enabled ? Bf16Gemm::kDot : Bf16Gemm::kFp32;
}
const KernelTable& kernels() { return cpu_state().table; }
}  // namespace cpu
}  // namespace fastformer

PYBIND11_MODULE(_C, m) {
  using namespace fastformer;
  namespace cb = fastformer::cpu_bindings;
  m.doc() = "fastformer compiled kernels (CPU; CUDA when built with it)";
  m.def("cpu_info", &cpu_info, "CPU capability levels built, selected and supported");
  m.def("set_cpu_capability", &set_cpu_capability, "Select default|avx2|avx512 kernels (tests)");
  m.def("set_cpu_amx", &set_cpu_amx, "Use AMX-BF16 at the avx512 level where supported (tests)");
  m.def("set_cpu_avx512_bf16", &set_cpu_avx512_bf16,
        "Use AVX512-BF16 for bf16 attention GEMMs at the avx512 level where AMX is not used (tests)");
  m.def("use_amx_bf16", &amx_in_use,
        "Whether bf16 runs on AMX tiles now (the avx512 kernels selected, AMX-BF16 usable and on)");
  m.def("option_fields", &option_fields, "{family: [option field names]} of csrc/options.h");
  m.def("add_norm_fwd", &cb::add_norm_fwd);
  m.def("add_norm_bwd", &cb::add_norm_bwd);
  m.def("add_norm_autograd", &cb::add_norm_autograd, "add + norm with a C++ autograd node: [y, res_out]");
  m.def("attention_fwd", &cb::attention_fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("with_residual") = true);
  m.def("attention_bwd", &cb::attention_bwd);
  m.def("rotary", &cb::rotary, py::arg("x"), py::arg("o"), py::arg("conj") = false);
  m.def("relative_bias_fwd", &cb::relative_bias_fwd, "DeBERTa's c2p + p2c bias, masked: (B, H, Lq, Lk)");
  m.def("relative_bias_bwd", &cb::relative_bias_bwd, "(dc2p, dp2c) of relative_bias_fwd (None where not needed)");
  m.def("ffn_fwd", &cb::ffn_fwd, py::arg("x"), py::arg("w1"), py::arg("b1"), py::arg("w2"), py::arg("b2"),
        py::arg("w_up"), py::arg("b_up"), py::arg("o"), py::arg("save_preactivation") = true);
  m.def("ffn_bwd", &cb::ffn_bwd);
  m.def("ffn_linear_fwd", &cb::ffn_linear_fwd, "x w^T + b on the FFN's packed GEMM", py::arg("x"),
        py::arg("w"), py::arg("b"), py::arg("out") = py::none());
  m.def("ffn_linear_bwd", &cb::ffn_linear_bwd, "{dx, dw, db} of ffn_linear_fwd");
  m.def("ffn_down_fwd", &cb::ffn_down_fwd, "(act(gate) [* up]) w2^T + b2 on the packed GEMM");
  m.def("ffn_down_bwd", &cb::ffn_down_bwd, "{d_gate, d_up, dw2, db2} of ffn_down_fwd");
  m.def("linear_rows", &cb::linear_rows, py::arg("x"), py::arg("weight"), py::arg("bias"));
  m.def("weight_grad", &cb::weight_grad, "P^T Q (or its transpose), bf16 on AMX: weight gradients",
        py::arg("p"), py::arg("q"), py::arg("transpose_c"), py::arg("out_dtype"));
  m.def("ffn_act_fwd", &cb::ffn_act_fwd, py::arg("gate"), py::arg("up"), py::arg("activation"),
        py::arg("over_gate") = false, py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none(),
        py::arg("limit") = 0.0, py::arg("up_shift") = 0.0);
  m.def("ffn_act_bwd", &cb::ffn_act_bwd, py::arg("dh"), py::arg("gate"), py::arg("up"),
        py::arg("activation"), py::arg("need_h"), py::arg("dropout_p") = 0.0,
        py::arg("rng_state") = py::none(), py::arg("limit") = 0.0, py::arg("up_shift") = 0.0);
  m.def("dropout", &cb::dropout, "x * keep / (1 - p) with the FFN's Philox mask (ops/dropout.py)",
        py::arg("x"), py::arg("p"), py::arg("rng_state"));
  m.def("lce_rows", &cb::lce_rows, "linear_cross_entropy: the row pass over a chunk of logits");
  m.def("lce_pair_add", &cb::lce_pair_add, "hi + lo += p (compensated bf16/fp16 accumulation)",
        py::arg("hi"), py::arg("lo"), py::arg("p"), py::arg("read_lo") = true, py::arg("write_lo") = true);
#ifdef FASTFORMER_WITH_CUDA
  namespace gb = fastformer::cuda_bindings;
  m.def("cuda_add_norm_fwd", &gb::add_norm_fwd);
  m.def("cuda_add_norm_bwd", &gb::add_norm_bwd);
  m.def("cuda_attention_fwd", &gb::attention_fwd);
  m.def("cuda_attention_bwd", &gb::attention_bwd);
  m.def("cuda_ffn_bias_act_fwd", &gb::ffn_bias_act_fwd, "y = act(x + bias), CUDA");
  m.def("cuda_ffn_bias_act_bwd", &gb::ffn_bias_act_bwd, "{dx, dbias}, CUDA");
  m.def("cuda_ffn_gated_act_fwd", &gb::ffn_gated_act_fwd, "h = act(gate) * up, CUDA");
  m.def("cuda_ffn_gated_act_bwd", &gb::ffn_gated_act_bwd, "{dgate, dup}, CUDA");
#endif
}
