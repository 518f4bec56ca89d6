// Shared argument checks for torchfn kernels. Every message names the op, the argument and
// what was seen (dtype/device/shape), so a user can fix the call without reading C++.
// Format numbers with shape_str / std::to_string, never by streaming an integer or an
// IntArrayRef into TORCH_CHECK: with some toolchains (seen on the GPU image, whose nvcc host
// compiler is /opt/gcc) the .so carries its own copy of libstdc++'s stream code, and
// streaming an integer there segfaulted.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>

// Dispatch over the four floating dtypes torchfn kernels accept.
#define TORCHFN_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace torchfn {
// TU-local on purpose: these are compiled by g++ (CPU files) and by nvcc (CUDA files); with
// internal linkage the two never get merged into one definition by the linker.
namespace {

// "[2, 3]" for sizes (2, 3); written out rather than through c10's ArrayRef printer.
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

// A fresh contiguous tensor with the sizes, dtype and device of `x`.
inline at::Tensor empty_contiguous_like(const at::Tensor& x) {
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// `x` must be a floating tensor (float32/float64/float16/bfloat16) on `device_type`.
inline void check_float_input(const char* op, const char* arg, const at::Tensor& x,
                              c10::DeviceType device_type) {
  TORCH_CHECK(x.defined(), "torchfn::", op, ": argument '", arg, "' is an undefined tensor");
  TORCH_CHECK(is_supported_float(x.scalar_type()), "torchfn::", op, ": argument '", arg,
              "' must be float32, float64, float16 or bfloat16, got dtype ", x.scalar_type(),
              " on device ", x.device());
  TORCH_CHECK(x.device().type() == device_type, "torchfn::", op, ": argument '", arg,
              "' must be on a ", c10::DeviceTypeName(device_type, /*lower_case=*/true),
              " device for this kernel, got device ", x.device());
}

// `other` must match `ref` in dtype, device and shape (elementwise binary kernels).
inline void check_same_as(const char* op, const char* arg, const at::Tensor& other,
                          const char* ref_arg, const at::Tensor& ref) {
  TORCH_CHECK(other.scalar_type() == ref.scalar_type(), "torchfn::", op, ": argument '", arg,
              "' must have the dtype of '", ref_arg, "' (", ref.scalar_type(), "), got ",
              other.scalar_type());
  TORCH_CHECK(other.device() == ref.device(), "torchfn::", op, ": argument '", arg,
              "' must be on the device of '", ref_arg, "' (", ref.device(), "), got ",
              other.device());
  TORCH_CHECK(other.sizes() == ref.sizes(), "torchfn::", op, ": argument '", arg,
              "' must have the shape of '", ref_arg, "' ", shape_str(ref.sizes()), ", got ",
              shape_str(other.sizes()));
}

}  // namespace

}  // namespace torchfn
