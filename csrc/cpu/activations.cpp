// CPU kernels of op 2 (sigmoid, leaky_relu and their backward kernels).
// Elementwise over contiguous memory, split across threads with at::parallel_for; half and
// bfloat16 are computed in float (at::opmath_type) and rounded once on store.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "../common.h"

namespace torchfn {
namespace {

constexpr int64_t kGrain = 32768;

template <typename scalar_t>
inline at::opmath_type<scalar_t> sigmoid_scalar(at::opmath_type<scalar_t> v) {
  using opmath_t = at::opmath_type<scalar_t>;
  return opmath_t(1) / (opmath_t(1) + std::exp(-v));
}

at::Tensor sigmoid_cpu(const at::Tensor& x_) {
  check_float_input("sigmoid", "x", x_, c10::DeviceType::CPU);
  const at::Tensor x = x_.contiguous();
  at::Tensor y = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::sigmoid", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        yp[i] = static_cast<scalar_t>(sigmoid_scalar<scalar_t>(xp[i]));
      }
    });
  });
  return y;
}

at::Tensor sigmoid_backward_cpu(const at::Tensor& grad_out_, const at::Tensor& y_) {
  check_float_input("sigmoid_backward", "y", y_, c10::DeviceType::CPU);
  check_float_input("sigmoid_backward", "grad_out", grad_out_, c10::DeviceType::CPU);
  check_same_as("sigmoid_backward", "grad_out", grad_out_, "y", y_);
  const at::Tensor g = grad_out_.contiguous();
  const at::Tensor y = y_.contiguous();
  at::Tensor dx = empty_contiguous_like(y);
  TORCHFN_DISPATCH_FLOATS(y.scalar_type(), "torchfn::sigmoid_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, y.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t yv = yp[i];
        dp[i] = static_cast<scalar_t>(static_cast<opmath_t>(gp[i]) * yv * (opmath_t(1) - yv));
      }
    });
  });
  return dx;
}

at::Tensor leaky_relu_cpu(const at::Tensor& x_, double negative_slope) {
  check_float_input("leaky_relu", "x", x_, c10::DeviceType::CPU);
  const at::Tensor x = x_.contiguous();
  at::Tensor y = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::leaky_relu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t slope = static_cast<opmath_t>(negative_slope);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t v = xp[i];
        yp[i] = static_cast<scalar_t>(v > opmath_t(0) ? v : v * slope);
      }
    });
  });
  return y;
}

at::Tensor leaky_relu_backward_cpu(const at::Tensor& grad_out_, const at::Tensor& x_,
                                   double negative_slope) {
  check_float_input("leaky_relu_backward", "x", x_, c10::DeviceType::CPU);
  check_float_input("leaky_relu_backward", "grad_out", grad_out_, c10::DeviceType::CPU);
  check_same_as("leaky_relu_backward", "grad_out", grad_out_, "x", x_);
  const at::Tensor g = grad_out_.contiguous();
  const at::Tensor x = x_.contiguous();
  at::Tensor dx = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::leaky_relu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t slope = static_cast<opmath_t>(negative_slope);
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t gv = gp[i];
        dp[i] = static_cast<scalar_t>(static_cast<opmath_t>(xp[i]) > opmath_t(0) ? gv : gv * slope);
      }
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CPU, m) {
  m.impl("sigmoid", &sigmoid_cpu);
  m.impl("sigmoid_backward", &sigmoid_backward_cpu);
  m.impl("leaky_relu", &leaky_relu_cpu);
  m.impl("leaky_relu_backward", &leaky_relu_backward_cpu);
}

}  // namespace torchfn
