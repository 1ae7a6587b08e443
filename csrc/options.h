// The options of each op family as C++ structs, field for field the Python option dataclasses
// (AttentionOptions in fastformer/ops/attention.py, NormOptions in ops/norm.py, FfnOptions in
// ops/ffn.py, RotaryOptions in ops/rotary.py, LinearCrossEntropyOptions in
// ops/linear_cross_entropy.py, RelativeBiasOptions in ops/relative_bias.py). pybind11 fills a
// struct straight from the Python object, reading each field by name (the casters below);
// _C.option_fields() lists the fields so that a test can check that both sides have the same
// ones in the same order.
//
// Adding an option: one X(type, name) line here, the same field in the Python dataclass, and
// the kernels that honour it (a backend whose Python Impl does not list the field never sees a
// call that sets it).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

namespace fastformer {

// X(type, name), in the Python dataclass's field order.
#define FF_ATTENTION_OPTIONS(X)                \
  X(int64_t, causal)                           \
  X(std::optional<double>, scale)              \
  X(double, dropout_p)                         \
  X(std::optional<at::Tensor>, rng_state)      \
  X(std::optional<at::Tensor>, attn_mask)      \
  X(std::optional<at::Tensor>, key_padding_mask) \
  X(int64_t, window_left)                      \
  X(int64_t, window_right)                     \
  X(double, softcap)                           \
  X(std::optional<at::Tensor>, alibi_slopes)   \
  X(std::optional<at::Tensor>, sinks)          \
  X(std::optional<at::Tensor>, rel_bias)       \
  X(std::optional<at::Tensor>, cu_seqlens_q)   \
  X(std::optional<at::Tensor>, cu_seqlens_k)   \
  X(int64_t, max_seqlen_q)                     \
  X(int64_t, max_seqlen_k)                     \
  X(std::optional<at::Tensor>, seqlens_k)      \
  X(std::optional<at::Tensor>, block_table)    \
  X(std::optional<at::Tensor>, leftpad_k)

#define FF_NORM_OPTIONS(X) \
  X(double, eps)           \
  X(bool, rms)             \
  X(bool, return_residual)

#define FF_FFN_OPTIONS(X)                 \
  X(int64_t, activation)                  \
  X(double, dropout_p)                    \
  X(std::optional<at::Tensor>, rng_state) \
  X(double, swiglu_limit)

#define FF_ROTARY_OPTIONS(X)        \
  X(std::optional<at::Tensor>, cos) \
  X(std::optional<at::Tensor>, sin) \
  X(bool, interleaved)

#define FF_LINEAR_CROSS_ENTROPY_OPTIONS(X)   \
  X(std::optional<at::Tensor>, target)       \
  X(int64_t, ignore_index)                   \
  X(double, label_smoothing)                 \
  X(int64_t, reduction)                      \
  X(double, softcap)                         \
  X(bool, grad_x)                            \
  X(bool, grad_weight)                       \
  X(bool, grad_bias)

#define FF_RELATIVE_BIAS_OPTIONS(X)       \
  X(std::optional<at::Tensor>, c2p_index) \
  X(std::optional<at::Tensor>, p2c_index) \
  X(std::optional<at::Tensor>, visible)

// Every family: X(struct name, field list, Python family name).
#define FF_OPTION_STRUCTS(X)                          \
  X(AttentionOptions, FF_ATTENTION_OPTIONS, "attention") \
  X(NormOptions, FF_NORM_OPTIONS, "add_norm")         \
  X(FfnOptions, FF_FFN_OPTIONS, "ffn")                \
  X(RotaryOptions, FF_ROTARY_OPTIONS, "rotary")      \
  X(LinearCrossEntropyOptions, FF_LINEAR_CROSS_ENTROPY_OPTIONS, "linear_cross_entropy") \
  X(RelativeBiasOptions, FF_RELATIVE_BIAS_OPTIONS, "relative_bias")

#define FF_OPTION_FIELD(type, name) type name{};
#define FF_OPTION_STRUCT(Struct, FIELDS, family) \
  struct Struct {                                \
    FIELDS(FF_OPTION_FIELD)                      \
  };
FF_OPTION_STRUCTS(FF_OPTION_STRUCT)
#undef FF_OPTION_STRUCT
#undef FF_OPTION_FIELD

// (seed, offset) of a dropout RNG state: an int64 CPU tensor [seed, offset], or (0, 0).
inline std::pair<uint64_t, uint64_t> seed_offset(const std::optional<at::Tensor>& rng_state) {
  if (!rng_state.has_value() || !rng_state->defined()) return {0, 0};
  TORCH_CHECK(rng_state->scalar_type() == at::kLong && rng_state->numel() == 2 &&
                  rng_state->device().is_cpu(),
              "fastformer._C: rng_state must be an int64 CPU tensor [seed, offset]");
  const at::Tensor s = rng_state->contiguous();
  const int64_t* p = s.data_ptr<int64_t>();
  return {static_cast<uint64_t>(p[0]), static_cast<uint64_t>(p[1])};
}

// The tensor of an optional field, if it holds one.
inline const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// {family: [field names]} of every option struct (a test compares them with the Python side).
inline pybind11::dict option_fields() {
  pybind11::dict d;
#define FF_FIELD_NAME(type, name) names.push_back(#name);
#define FF_FIELD_NAMES(Struct, FIELDS, family) \
  {                                            \
    std::vector<std::string> names;            \
    FIELDS(FF_FIELD_NAME)                      \
    d[family] = names;                         \
  }
  FF_OPTION_STRUCTS(FF_FIELD_NAMES)
#undef FF_FIELD_NAMES
#undef FF_FIELD_NAME
  return d;
}

}  // namespace fastformer

// pybind11 casters: a Python options object -> the struct, field by field by attribute name.
namespace pybind11::detail {
// Attribute names are interned once (attr("name") would build a Python string per field and
// call).
#define FF_LOAD_FIELD(type, name)                                                      \
  {                                                                                    \
    static PyObject* const key = PyUnicode_InternFromString(#name);                    \
    value.name = reinterpret_steal<object>(PyObject_GetAttr(src.ptr(), key)).cast<type>(); \
  }
#define FF_STORE_FIELD(type, name) d[#name] = pybind11::cast(v.name);
#define FF_OPTION_CASTER(Struct, FIELDS, family)                                          \
  template <>                                                                             \
  struct type_caster<fastformer::Struct> {                                                \
    PYBIND11_TYPE_CASTER(fastformer::Struct, const_name(#Struct));                        \
    bool load(handle src, bool) {                                                         \
      if (src.is_none()) return false;                                                    \
      FIELDS(FF_LOAD_FIELD)                                                               \
      return true;                                                                        \
    }                                                                                     \
    static handle cast(const fastformer::Struct& v, return_value_policy, handle) {        \
      pybind11::dict d;                                                                   \
      FIELDS(FF_STORE_FIELD)                                                              \
      return d.release();                                                                 \
    }                                                                                     \
  };
FF_OPTION_STRUCTS(FF_OPTION_CASTER)
#undef FF_OPTION_CASTER
#undef FF_STORE_FIELD
#undef FF_LOAD_FIELD
}  // namespace pybind11::detail
