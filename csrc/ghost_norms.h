// Op 3: per-sample ("ghost") gradient norms of a linear layer y = a W^T + b, and the clipped
// weighted gradient sum of book-keeping DP-SGD -- shared declarations.
//
// With input activations a (B, d_in) or (B, T, d_in) and output gradients g (B, d_out) or
// (B, T, d_out), sample i's weight gradient is G_i = g_i^T a_i (d_out, d_in). Its squared norm
// is computed without materialising it where that is cheaper:
//   2-D: ||G_i||^2 = ||a_i||^2 ||g_i||^2                  (one fused pass over a and g)
//   3-D: ||G_i||^2 = <a_i a_i^T, g_i g_i^T>               ("gram", O(B T^2 (d_in + d_out)))
//                  = ||g_i^T a_i||^2                       ("materialize", O(B T d_in d_out))
// The bias gradient of sample i is s_i = sum_t g_it; `bias=true` adds ||s_i||^2.
//
// The 3-D paths and the clipped sum are device-generic ATen code (at::bmm/at::mm reach cuBLAS
// on CUDA), defined once in cpu/ghost_norms.cpp and called by both devices' kernels. The
// temporaries of the path the "auto" rule picks are never larger than a and g together.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace torchfn {
namespace ghost {

// Checks that a and g are float tensors on `device_type` with equal dtype and device, 2 or 3
// dims, equal dims, and equal batch (and time) sizes. Messages name the op and both shapes.
void check_pair(const char* op, const at::Tensor& a, const at::Tensor& g,
                c10::DeviceType device_type);

// Checks that `arg` (e.g. coef or grad) is a (B,) tensor of a's dtype and device.
void check_per_sample(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& a);

// Returns true for the Gram path. method: "gram", "materialize" or "auto", which picks the
// Gram form iff T * (d_in + d_out) <= d_in * d_out (fewer multiply-adds; it then also needs
// less temporary memory: 2 T^2 <= d_in d_out / 2).
bool use_gram(const char* op, c10::string_view method, int64_t T, int64_t d_in, int64_t d_out);

// (norms (B,), aux) for contiguous 3-D a, g (any device). aux holds what the backward reuses:
// gram -> (B, 2, T, T) [a_i a_i^T, g_i g_i^T]; materialize -> (B, d_out, d_in) g_i^T a_i.
std::tuple<at::Tensor, at::Tensor> norms_sq_3d(const at::Tensor& a, const at::Tensor& g, bool bias,
                                               bool gram);

// (grad_a, grad_g) of sum_i grad_i * norms_sq_i for contiguous 3-D a, g (any device); `aux`
// is norms_sq_3d's (same path), or undefined to recompute it.
std::tuple<at::Tensor, at::Tensor> norms_sq_3d_backward(const at::Tensor& grad,
                                                        const at::Tensor& a,
                                                        const at::Tensor& g,
                                                        const at::Tensor& aux, bool bias,
                                                        bool gram);

// Checks the forward's `aux` handed back to the backward (shape, dtype and device for the path):
// 2-D -> (B, 2) float32 (float64 for float64 inputs) [||a_i||^2, ||g_i||^2].
void check_aux(const char* op, const at::Tensor& aux, const at::Tensor& a, const at::Tensor& g,
               bool gram);

// dtype of the 2-D aux: the accumulation type (float64 for float64, else float32).
inline at::ScalarType opmath_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// (d_out, d_in) sum_i coef_i g_i^T a_i for contiguous 2-D or 3-D a, g (any device).
at::Tensor clipped_sum(const at::Tensor& a, const at::Tensor& g, const at::Tensor& coef);

}  // namespace ghost
}  // namespace torchfn
