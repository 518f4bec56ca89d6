// Argument checks shared by the CPU and CUDA kernels of op 1 (softmax_cross_entropy and its
// backward / double-backward kernels). Every message names the op, the argument and what was
// seen, like the checks of common.h.
//
// Shapes and dtypes (N rows, C classes; opmath = float for half/bfloat16, else the dtype):
//   logits (N, C) float*, target (N,) int64, grad_loss (N,) opmath, grad_grad_logits (N, C)
//   like logits, label_smoothing in [0, 1], and the forward's saved row statistics
//   stats (N, 2) opmath: [:, 0] = max_j x_ij, [:, 1] = log sum_j exp(x_ij - max), so that
//   log softmax = (x - max) - logsum is as exact as torch's (x - lse with a rounded lse is not,
//   for logits of large magnitude).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "common.h"

namespace torchfn {
namespace xent {
// TU-local like common.h's helpers: g++ (CPU file) and nvcc (CUDA file) each keep their own.
namespace {

// Numbers in messages go through strings (see common.h: never stream an integer).
inline std::string num_str(int64_t v) { return std::to_string(v); }
inline std::string num_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// The (N, C) logits of a cross-entropy kernel: floating, 2-D, at least one class, on device.
inline void check_logits(const char* op, const at::Tensor& logits, c10::DeviceType dev) {
  check_float_input(op, "logits", logits, dev);
  TORCH_CHECK(logits.dim() == 2, "torchfn::", op, ": argument 'logits' must be 2-D (N, C), got ",
              num_str(logits.dim()), "-D shape ", shape_str(logits.sizes()));
  TORCH_CHECK(logits.size(1) > 0 || logits.size(0) == 0, "torchfn::", op,
              ": argument 'logits' must have at least one class (C >= 1), got shape ",
              shape_str(logits.sizes()));
}

// `target` must be an int64 (N,) tensor on the device of `logits`.
inline void check_target(const char* op, const at::Tensor& target, const at::Tensor& logits) {
  TORCH_CHECK(target.defined(), "torchfn::", op, ": argument 'target' is an undefined tensor");
  TORCH_CHECK(target.scalar_type() == at::kLong, "torchfn::", op,
              ": argument 'target' must hold int64 class indices, got dtype ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), "torchfn::", op,
              ": argument 'target' must be on the device of 'logits' (", logits.device(),
              "), got ", target.device());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "torchfn::", op,
              ": argument 'target' must have shape (N,) = [", num_str(logits.size(0)),
              "] to match 'logits' ", shape_str(logits.sizes()), ", got ",
              shape_str(target.sizes()));
}

// A per-row (N,) tensor in the opmath dtype of `logits` (grad_loss).
inline void check_row_vector(const char* op, const char* arg, const at::Tensor& v,
                             const at::Tensor& logits) {
  TORCH_CHECK(v.defined(), "torchfn::", op, ": argument '", arg, "' is an undefined tensor");
  const at::ScalarType want = at::toOpMathType(logits.scalar_type());
  TORCH_CHECK(v.scalar_type() == want, "torchfn::", op, ": argument '", arg,
              "' must have dtype ", want, " (the accumulation dtype of 'logits' ",
              logits.scalar_type(), "), got ", v.scalar_type());
  TORCH_CHECK(v.device() == logits.device(), "torchfn::", op, ": argument '", arg,
              "' must be on the device of 'logits' (", logits.device(), "), got ", v.device());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == logits.size(0), "torchfn::", op, ": argument '", arg,
              "' must have shape (N,) = [", num_str(logits.size(0)), "], got ",
              shape_str(v.sizes()));
}

// The (N, 2) row statistics in the opmath dtype of `logits`.
inline void check_stats(const char* op, const at::Tensor& v, const at::Tensor& logits) {
  TORCH_CHECK(v.defined(), "torchfn::", op, ": argument 'stats' is an undefined tensor");
  const at::ScalarType want = at::toOpMathType(logits.scalar_type());
  TORCH_CHECK(v.scalar_type() == want, "torchfn::", op, ": argument 'stats' must have dtype ",
              want, " (the accumulation dtype of 'logits' ", logits.scalar_type(), "), got ",
              v.scalar_type());
  TORCH_CHECK(v.device() == logits.device(), "torchfn::", op,
              ": argument 'stats' must be on the device of 'logits' (", logits.device(),
              "), got ", v.device());
  TORCH_CHECK(v.dim() == 2 && v.size(0) == logits.size(0) && v.size(1) == 2, "torchfn::", op,
              ": argument 'stats' must have shape (N, 2) = [", num_str(logits.size(0)),
              ", 2], got ", shape_str(v.sizes()));
}

inline void check_smoothing(const char* op, double label_smoothing) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "torchfn::", op,
              ": argument 'label_smoothing' must be in [0, 1], got ", num_str(label_smoothing));
}

// Host-side range check of the class indices (CPU kernels): every target is in [0, C) or
// equals ignore_index. Names the first offending row.
inline void check_target_values(const char* op, const at::Tensor& target, int64_t n_classes,
                                int64_t ignore_index) {
  const int64_t* t = target.const_data_ptr<int64_t>();
  const int64_t n = target.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = t[i];
    TORCH_CHECK(v == ignore_index || (v >= 0 && v < n_classes), "torchfn::", op,
                ": argument 'target' holds class index ", num_str(v), " at row ", num_str(i),
                ", outside [0, C) = [0, ", num_str(n_classes), ") and not ignore_index (",
                num_str(ignore_index), ")");
  }
}

}  // namespace
}  // namespace xent
}  // namespace torchfn
