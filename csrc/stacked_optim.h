// Shared math and argument checks of op 4: fused Adam/SGD updates over stacked parameters.
//
// A leaf holds N members' parameters stacked along dim 0, `(N, ...)`; element `i` of the
// contiguous leaf belongs to member `i / inner` with `inner = numel / N`. Per-member
// hyperparameters (lr, weight_decay, the step count) are 0-d (shared) or `(N,)` tensors, read
// on the device (no host sync). The per-element arithmetic below is compiled for both the CPU
// (csrc/cpu/stacked_optim.cpp) and the CUDA kernels (csrc/cuda/stacked_optim.cu), so they
// agree to the last bit on a given input; the Python twins (torchfn/ops/reference.py) follow
// the same order of operations.
//
// Precision: arithmetic in at::opmath_type of the parameter dtype (float for half/bfloat16);
// the bias corrections 1 - beta^t are computed in double, once per member.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <optional>

#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"

namespace torchfn {
namespace optim {
// TU-local, like common.h: compiled by g++ (CPU files) and nvcc (CUDA files), never merged.
namespace {

// Compile-time constants of one Adam call (same for every element).
template <typename T>
struct AdamConsts {
  T b1, omb1, b2, omb2, eps, eps_root;
  double b1d, b2d;
  bool l2, decoupled, maximize;
};

// Per-member coefficients of Adam, computed once per member.
template <typename T>
struct AdamMember {
  T lr, wd, inv_bc1, inv_bc2;
};

template <typename T>
C10_HOST_DEVICE inline AdamMember<T> adam_member(const AdamConsts<T>& k, const T* lr,
                                                 int64_t lr_stride, const T* wd,
                                                 int64_t wd_stride, const int64_t* count,
                                                 int64_t count_stride, int64_t m) {
  AdamMember<T> c;
  c.lr = lr[m * lr_stride];
  c.wd = wd != nullptr ? wd[m * wd_stride] : T(0);
  const double t = static_cast<double>(count[m * count_stride]);
  c.inv_bc1 = static_cast<T>(1.0 / (1.0 - std::pow(k.b1d, t)));
  c.inv_bc2 = static_cast<T>(1.0 / (1.0 - std::pow(k.b2d, t)));
  return c;
}

// One Adam step of one element: moments and the update to add to the parameter.
template <typename T>
C10_HOST_DEVICE inline void adam_elem(const AdamConsts<T>& k, const AdamMember<T>& c, T g, T m,
                                      T v, T p, T& upd, T& m_out, T& v_out) {
  if (k.maximize) g = -g;
  if (k.l2) g = g + c.wd * p;
  m_out = k.b1 * m + k.omb1 * g;
  v_out = k.b2 * v + k.omb2 * (g * g);
  const T denom = std::sqrt(v_out * c.inv_bc2 + k.eps_root) + k.eps;
  T u = -(c.lr * (m_out * c.inv_bc1)) / denom;
  if (k.decoupled) u = u - c.lr * c.wd * p;
  upd = u;
}

template <typename T>
struct SgdConsts {
  T momentum, omd;  // omd = 1 - dampening
  bool l2, has_buf, nesterov, maximize;
};

template <typename T>
struct SgdMember {
  T lr, wd;
  bool first;  // the first step (count == 1): the buffer starts as the gradient itself
};

template <typename T>
C10_HOST_DEVICE inline SgdMember<T> sgd_member(const T* lr, int64_t lr_stride, const T* wd,
                                               int64_t wd_stride, const int64_t* count,
                                               int64_t count_stride, int64_t m) {
  SgdMember<T> c;
  c.lr = lr[m * lr_stride];
  c.wd = wd != nullptr ? wd[m * wd_stride] : T(0);
  c.first = count[m * count_stride] <= 1;
  return c;
}

// One SGD step of one element (torch.optim.SGD): the update and the new momentum buffer.
template <typename T>
C10_HOST_DEVICE inline void sgd_elem(const SgdConsts<T>& k, const SgdMember<T>& c, T g, T buf,
                                     T p, T& upd, T& buf_out) {
  if (k.maximize) g = -g;
  if (k.l2) g = g + c.wd * p;
  T d = g;
  if (k.has_buf) {
    const T b = c.first ? g : k.momentum * buf + k.omd * g;
    buf_out = b;
    d = k.nesterov ? g + k.momentum * b : b;
  }
  upd = -(c.lr * d);
}

// ----------------------------------------------------------------------------------------
// Argument checks shared by the CPU and CUDA kernels.

inline at::ScalarType opmath_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// A per-member tensor (lr, weight_decay): 0-d or (N,), dtype opmath(param dtype), on `ref`'s
// device. Returns its stride over members (0 for a 0-d tensor).
inline int64_t check_member_tensor(const char* op, const char* arg, const at::Tensor& t,
                                   const at::Tensor& ref, at::ScalarType dtype) {
  const int64_t n = ref.size(0);
  TORCH_CHECK(t.dim() == 0 || (t.dim() == 1 && t.size(0) == n), "torchfn::", op,
              ": argument '", arg, "' must be 0-d or have shape (N,) = (", std::to_string(n),
              ",) (one value per member, N = grad.size(0)), got shape ", shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == dtype, "torchfn::", op, ": argument '", arg, "' must have dtype ",
              dtype, " (the compute dtype of grad's ", ref.scalar_type(), "), got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), "torchfn::", op, ": argument '", arg,
              "' must be on the device of 'grad' (", ref.device(), "), got ", t.device());
  return t.dim() == 0 ? 0 : 1;
}

inline int64_t check_count(const char* op, const at::Tensor& count, const at::Tensor& ref) {
  const int64_t n = ref.size(0);
  TORCH_CHECK(count.dim() == 0 || (count.dim() == 1 && count.size(0) == n), "torchfn::", op,
              ": argument 'count' must be 0-d or have shape (N,) = (", std::to_string(n),
              ",), got shape ", shape_str(count.sizes()));
  TORCH_CHECK(count.scalar_type() == at::kLong, "torchfn::", op,
              ": argument 'count' must be int64, got ", count.scalar_type());
  TORCH_CHECK(count.device() == ref.device(), "torchfn::", op,
              ": argument 'count' must be on the device of 'grad' (", ref.device(), "), got ",
              count.device());
  return count.dim() == 0 ? 0 : 1;
}

// A state tensor (mu, nu, momentum_buffer): grad's shape and device; dtype grad's, or float32
// when grad is float16/bfloat16 (moments kept in float32 for low-precision parameters).
inline void check_state(const char* op, const char* arg, const at::Tensor& s,
                        const at::Tensor& grad) {
  TORCH_CHECK(s.device() == grad.device(), "torchfn::", op, ": argument '", arg,
              "' must be on the device of 'grad' (", grad.device(), "), got ", s.device());
  TORCH_CHECK(s.sizes() == grad.sizes(), "torchfn::", op, ": argument '", arg,
              "' must have the shape of 'grad' ", shape_str(grad.sizes()), ", got ",
              shape_str(s.sizes()));
  const bool low = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  TORCH_CHECK(s.scalar_type() == grad.scalar_type() || (low && s.scalar_type() == at::kFloat),
              "torchfn::", op, ": argument '", arg, "' must have the dtype of 'grad' (",
              grad.scalar_type(), ")", low ? " or float32" : "", ", got ", s.scalar_type());
}

// The checks of `grad` (float, on `device_type`, member dim 0) and `param` shared by both ops.
inline void check_grad_param(const char* op, const at::Tensor& grad,
                             const std::optional<at::Tensor>& param,
                             const std::optional<at::Tensor>& weight_decay,
                             c10::DeviceType device_type) {
  check_float_input(op, "grad", grad, device_type);
  TORCH_CHECK(grad.dim() >= 1, "torchfn::", op,
              ": argument 'grad' must have a member dim 0 of size N, got a 0-d tensor");
  TORCH_CHECK(param.has_value() == weight_decay.has_value(), "torchfn::", op,
              ": arguments 'param' and 'weight_decay' must be given together (param is only "
              "read for weight decay), got param ",
              param.has_value() ? "given" : "None", " and weight_decay ",
              weight_decay.has_value() ? "given" : "None");
  if (param.has_value()) {
    check_float_input(op, "param", *param, device_type);
    check_same_as(op, "param", *param, "grad", grad);
  }
}

// The lists of a multi-leaf op: `state` (mu / momentum_buffer) as long as `grad` (or empty
// when not required), `state2` (nu) likewise when given, `param` as long as `grad` exactly when
// weight decay is given. Per-leaf checks are those of the single-leaf op.
inline void check_multi_lists(const char* op, at::TensorList grad, at::TensorList state,
                              const char* state_arg, at::TensorList state2,
                              const char* state2_arg, at::TensorList param, bool has_wd,
                              bool state_required) {
  const std::string n = std::to_string(grad.size());
  TORCH_CHECK(state.size() == grad.size() || (!state_required && state.empty()), "torchfn::",
              op, ": argument '", state_arg, "' must list one tensor per leaf (", n,
              ")", state_required ? "" : " or be empty", ", got ",
              std::to_string(state.size()));
  TORCH_CHECK(state2_arg == nullptr || state2.size() == grad.size(), "torchfn::", op,
              ": argument '", state2_arg == nullptr ? "" : state2_arg,
              "' must list one tensor per leaf (", n, "), got ", std::to_string(state2.size()));
  TORCH_CHECK(param.size() == (has_wd ? grad.size() : 0), "torchfn::", op,
              ": argument 'param' must list one tensor per leaf (", n,
              ") when weight_decay is given and be empty otherwise, got ",
              std::to_string(param.size()), " tensors and weight_decay ",
              has_wd ? "given" : "None");
}

}  // namespace
}  // namespace optim
}  // namespace torchfn
