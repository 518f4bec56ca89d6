// CUDA kernels of op 2 (sigmoid, leaky_relu and their backward kernels).
// Bandwidth-bound elementwise kernels built on the vectorised launchers of elementwise.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "elementwise.cuh"

namespace torchfn {
namespace {

template <typename opmath_t>
struct SigmoidOp {
  __device__ __forceinline__ opmath_t operator()(opmath_t v) const {
    return opmath_t(1) / (opmath_t(1) + exp(-v));
  }
};

template <typename opmath_t>
struct SigmoidBackwardOp {  // (grad_out, y) -> grad_out * y * (1 - y)
  __device__ __forceinline__ opmath_t operator()(opmath_t g, opmath_t y) const {
    return g * y * (opmath_t(1) - y);
  }
};

template <typename opmath_t>
struct LeakyReluOp {
  opmath_t slope;
  __device__ __forceinline__ opmath_t operator()(opmath_t v) const {
    return v > opmath_t(0) ? v : v * slope;
  }
};

template <typename opmath_t>
struct LeakyReluBackwardOp {  // (grad_out, x) -> x > 0 ? grad_out : grad_out * slope
  opmath_t slope;
  __device__ __forceinline__ opmath_t operator()(opmath_t g, opmath_t x) const {
    return x > opmath_t(0) ? g : g * slope;
  }
};

at::Tensor sigmoid_cuda(const at::Tensor& x_) {
  check_float_input("sigmoid", "x", x_, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = x_.contiguous();
  at::Tensor y = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::sigmoid", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    cuda::launch_unary(x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), x.numel(),
                       SigmoidOp<opmath_t>{});
  });
  return y;
}

at::Tensor sigmoid_backward_cuda(const at::Tensor& grad_out_, const at::Tensor& y_) {
  check_float_input("sigmoid_backward", "y", y_, c10::DeviceType::CUDA);
  check_float_input("sigmoid_backward", "grad_out", grad_out_, c10::DeviceType::CUDA);
  check_same_as("sigmoid_backward", "grad_out", grad_out_, "y", y_);
  const c10::cuda::CUDAGuard guard(y_.device());
  const at::Tensor g = grad_out_.contiguous();
  const at::Tensor y = y_.contiguous();
  at::Tensor dx = empty_contiguous_like(y);
  TORCHFN_DISPATCH_FLOATS(y.scalar_type(), "torchfn::sigmoid_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    cuda::launch_binary(g.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
                        dx.mutable_data_ptr<scalar_t>(), y.numel(), SigmoidBackwardOp<opmath_t>{});
  });
  return dx;
}

at::Tensor leaky_relu_cuda(const at::Tensor& x_, double negative_slope) {
  check_float_input("leaky_relu", "x", x_, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = x_.contiguous();
  at::Tensor y = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::leaky_relu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    cuda::launch_unary(x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), x.numel(),
                       LeakyReluOp<opmath_t>{static_cast<opmath_t>(negative_slope)});
  });
  return y;
}

at::Tensor leaky_relu_backward_cuda(const at::Tensor& grad_out_, const at::Tensor& x_,
                                    double negative_slope) {
  check_float_input("leaky_relu_backward", "x", x_, c10::DeviceType::CUDA);
  check_float_input("leaky_relu_backward", "grad_out", grad_out_, c10::DeviceType::CUDA);
  check_same_as("leaky_relu_backward", "grad_out", grad_out_, "x", x_);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor g = grad_out_.contiguous();
  const at::Tensor x = x_.contiguous();
  at::Tensor dx = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::leaky_relu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    cuda::launch_binary(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                        dx.mutable_data_ptr<scalar_t>(), x.numel(),
                        LeakyReluBackwardOp<opmath_t>{static_cast<opmath_t>(negative_slope)});
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CUDA, m) {
  m.impl("sigmoid", &sigmoid_cuda);
  m.impl("sigmoid_backward", &sigmoid_backward_cuda);
  m.impl("leaky_relu", &leaky_relu_cuda);
  m.impl("leaky_relu_backward", &leaky_relu_backward_cuda);
}

}  // namespace torchfn
