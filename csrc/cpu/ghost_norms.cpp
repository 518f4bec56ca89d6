// CPU kernels of op 3 (linear_grad_norms_sq, its backward, clipped_linear_grad_sum), plus the
// device-generic ATen code of the 3-D paths and of the clipped sum (csrc/ghost_norms.h), which
// the CUDA kernels call too.
//
// 2-D inputs: at::parallel_for over samples; each sample's two squared row norms are summed in
// at::opmath_type (float for half/bfloat16) with four independent accumulators, and outputs are
// rounded once. 3-D inputs: batched Gram or materialised products through at::bmm.
// The forward also returns `aux` (the row norms, the Gram matrices or g^T a) so that the
// backward is a single pass (2-D) or two GEMMs (3-D) instead of recomputing them.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "../common.h"
#include "../ghost_norms.h"

namespace torchfn {
namespace ghost {

void check_pair(const char* op, const at::Tensor& a, const at::Tensor& g,
                c10::DeviceType device_type) {
  check_float_input(op, "a", a, device_type);
  check_float_input(op, "g", g, device_type);
  TORCH_CHECK(a.dim() == 2 || a.dim() == 3, "torchfn::", op,
              ": argument 'a' must have 2 dims (batch, d_in) or 3 dims (batch, time, d_in), got "
              "shape ", shape_str(a.sizes()));
  TORCH_CHECK(g.dim() == a.dim(), "torchfn::", op, ": argument 'g' must have as many dims as 'a' ",
              shape_str(a.sizes()), ", got shape ", shape_str(g.sizes()));
  TORCH_CHECK(g.scalar_type() == a.scalar_type(), "torchfn::", op,
              ": argument 'g' must have the dtype of 'a' (", a.scalar_type(), "), got ",
              g.scalar_type());
  TORCH_CHECK(g.device() == a.device(), "torchfn::", op,
              ": argument 'g' must be on the device of 'a' (", a.device(), "), got ", g.device());
  const bool same_lead = a.size(0) == g.size(0) && (a.dim() == 2 || a.size(1) == g.size(1));
  TORCH_CHECK(same_lead, "torchfn::", op, ": arguments 'a' ", shape_str(a.sizes()), " and 'g' ",
              shape_str(g.sizes()),
              " must agree in the batch", a.dim() == 3 ? " and time dims" : " dim");
}

void check_per_sample(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& a) {
  check_float_input(op, arg, t, a.device().type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == a.size(0), "torchfn::", op, ": argument '", arg,
              "' must have shape [", std::to_string(a.size(0)), "] (one value per sample of 'a' ",
              shape_str(a.sizes()), "), got ", shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == a.scalar_type(), "torchfn::", op, ": argument '", arg,
              "' must have the dtype of 'a' (", a.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == a.device(), "torchfn::", op, ": argument '", arg,
              "' must be on the device of 'a' (", a.device(), "), got ", t.device());
}

bool use_gram(const char* op, c10::string_view method, int64_t T, int64_t d_in, int64_t d_out) {
  if (method == "gram") return true;
  if (method == "materialize") return false;
  TORCH_CHECK(method == "auto", "torchfn::", op,
              ": argument 'method' must be 'auto', 'gram' or 'materialize', got '",
              std::string(method.data(), method.size()), "'");
  return T * (d_in + d_out) <= d_in * d_out;
}

void check_aux(const char* op, const at::Tensor& aux, const at::Tensor& a, const at::Tensor& g,
               bool gram) {
  const int64_t B = a.size(0);
  std::vector<int64_t> want;
  at::ScalarType dtype = a.scalar_type();
  if (a.dim() == 2) {
    want = {B, 2};
    dtype = opmath_dtype(a.scalar_type());
  } else if (gram) {
    want = {B, 2, a.size(1), a.size(1)};
  } else {
    want = {B, g.size(2), a.size(2)};
  }
  TORCH_CHECK(aux.sizes() == at::IntArrayRef(want), "torchfn::", op,
              ": argument 'aux' must be the forward's aux for these inputs, of shape ",
              shape_str(at::IntArrayRef(want)), ", got ", shape_str(aux.sizes()));
  TORCH_CHECK(aux.scalar_type() == dtype, "torchfn::", op, ": argument 'aux' must have dtype ",
              dtype, ", got ", aux.scalar_type());
  TORCH_CHECK(aux.device() == a.device(), "torchfn::", op,
              ": argument 'aux' must be on the device of 'a' (", a.device(), "), got ",
              aux.device());
}

namespace {

// Product of the sizes of dims [begin, end) of x (explicit sizes: reshape(-1) is ambiguous for
// empty tensors).
int64_t numel_of_dims(const at::Tensor& x, int64_t begin, int64_t end) {
  int64_t n = 1;
  for (int64_t d = begin; d < end; ++d) n *= x.size(d);
  return n;
}

// (B,) <x_i, y_i> for same-shaped x, y (the reduction accumulates in float or wider).
at::Tensor batched_dot(const at::Tensor& x, const at::Tensor& y) {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
  return at::sum(at::mul(x, y), dims);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> norms_sq_3d(const at::Tensor& a, const at::Tensor& g, bool bias,
                                               bool gram) {
  at::Tensor out, aux;
  if (gram) {
    const at::Tensor gram_a = at::bmm(a, a.transpose(1, 2));  // (B, T, T)
    const at::Tensor gram_g = at::bmm(g, g.transpose(1, 2));
    out = batched_dot(gram_a, gram_g);
    aux = at::stack({gram_a, gram_g}, 1);
  } else {
    aux = at::bmm(g.transpose(1, 2), a);  // (B, d_out, d_in): the per-sample weight gradients
    out = batched_dot(aux, aux);
  }
  if (bias) {
    const at::Tensor s = at::sum(g, {1});  // (B, d_out): per-sample bias gradients
    out.add_(batched_dot(s, s));
  }
  return {out, aux};
}

std::tuple<at::Tensor, at::Tensor> norms_sq_3d_backward(const at::Tensor& grad,
                                                        const at::Tensor& a,
                                                        const at::Tensor& g,
                                                        const at::Tensor& aux, bool bias,
                                                        bool gram) {
  const at::Tensor scale = at::mul(grad, 2).reshape({grad.size(0), 1, 1});
  at::Tensor da, dg;
  if (gram) {  // da = 2w (g g^T) a, dg = 2w (a a^T) g
    const at::Tensor gram_a = aux.defined() ? aux.select(1, 0) : at::bmm(a, a.transpose(1, 2));
    const at::Tensor gram_g = aux.defined() ? aux.select(1, 1) : at::bmm(g, g.transpose(1, 2));
    da = at::bmm(at::mul(gram_g, scale), a);
    dg = at::bmm(at::mul(gram_a, scale), g);
  } else {  // G = g^T a: da = 2w g G, dg = 2w a G^T
    const at::Tensor grad_w =
        at::mul(aux.defined() ? aux : at::bmm(g.transpose(1, 2), a), scale);
    da = at::bmm(g, grad_w);
    dg = at::bmm(a, grad_w.transpose(1, 2));
  }
  if (bias) {  // d ||sum_t g_t||^2 / d g_t = 2 sum_t g_t, for every t
    dg.add_(at::sum(g, {1}, /*keepdim=*/true).mul_(scale));
  }
  return {da, dg};
}

at::Tensor clipped_sum(const at::Tensor& a, const at::Tensor& g, const at::Tensor& coef) {
  // sum_i coef_i g_i^T a_i = g_flat^T (coef * a)_flat: scale the smaller operand, one GEMM
  // over K = B (or B*T).
  const int64_t d_in = a.size(-1);
  const int64_t d_out = g.size(-1);
  const int64_t rows = numel_of_dims(a, 0, a.dim() - 1);  // K = B or B*T
  const int64_t B = a.size(0);
  const at::Tensor c = a.dim() == 3 ? coef.reshape({B, 1, 1}) : coef.reshape({B, 1});
  if (d_in <= d_out) {
    return at::mm(g.reshape({rows, d_out}).t(), at::mul(a, c).reshape({rows, d_in}));
  }
  return at::mm(at::mul(g, c).reshape({rows, d_out}).t(), a.reshape({rows, d_in}));
}

}  // namespace ghost

namespace {

constexpr int64_t kGrain = 32768;  // elements per parallel_for chunk

template <typename scalar_t>
inline at::opmath_type<scalar_t> sum_sq(const scalar_t* p, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const opmath_t v0 = p[k], v1 = p[k + 1], v2 = p[k + 2], v3 = p[k + 3];
    s0 += v0 * v0;
    s1 += v1 * v1;
    s2 += v2 * v2;
    s3 += v3 * v3;
  }
  for (; k < n; ++k) {
    const opmath_t v = p[k];
    s0 += v * v;
  }
  return (s0 + s1) + (s2 + s3);
}

int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_len));
}

std::tuple<at::Tensor, at::Tensor> linear_grad_norms_sq_cpu(const at::Tensor& a_,
                                                            const at::Tensor& g_, bool bias,
                                                            c10::string_view method) {
  constexpr const char* op = "linear_grad_norms_sq";
  ghost::check_pair(op, a_, g_, c10::DeviceType::CPU);
  const at::Tensor a = a_.contiguous();
  const at::Tensor g = g_.contiguous();
  if (a.dim() == 3) {
    const bool gram = ghost::use_gram(op, method, a.size(1), a.size(2), g.size(2));
    return ghost::norms_sq_3d(a, g, bias, gram);
  }
  ghost::use_gram(op, method, 1, a.size(1), g.size(1));  // validates `method` only
  const int64_t B = a.size(0), d_in = a.size(1), d_out = g.size(1);
  at::Tensor out = at::empty({B}, a.options());
  at::Tensor aux = at::empty({B, 2}, a.options().dtype(ghost::opmath_dtype(a.scalar_type())));
  TORCHFN_DISPATCH_FLOATS(a.scalar_type(), "torchfn::linear_grad_norms_sq", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* outp = out.mutable_data_ptr<scalar_t>();
    opmath_t* auxp = aux.mutable_data_ptr<opmath_t>();
    const opmath_t beta = bias ? opmath_t(1) : opmath_t(0);
    at::parallel_for(0, B, row_grain(d_in + d_out), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t sa = sum_sq(ap + i * d_in, d_in);
        const opmath_t sg = sum_sq(gp + i * d_out, d_out);
        outp[i] = static_cast<scalar_t>((sa + beta) * sg);
        auxp[2 * i] = sa;
        auxp[2 * i + 1] = sg;
      }
    });
  });
  return {out, aux};
}

std::tuple<at::Tensor, at::Tensor> linear_grad_norms_sq_backward_cpu(
    const at::Tensor& grad_, const at::Tensor& a_, const at::Tensor& g_,
    const std::optional<at::Tensor>& aux_, bool bias, c10::string_view method) {
  constexpr const char* op = "linear_grad_norms_sq_backward";
  ghost::check_pair(op, a_, g_, c10::DeviceType::CPU);
  ghost::check_per_sample(op, "grad", grad_, a_);
  const bool gram = ghost::use_gram(op, method, a_.dim() == 3 ? a_.size(1) : 1,
                                    a_.size(-1), g_.size(-1));
  const bool has_aux = aux_.has_value() && aux_->defined();
  if (has_aux) ghost::check_aux(op, *aux_, a_, g_, gram);
  const at::Tensor aux = has_aux ? aux_->contiguous() : at::Tensor();
  const at::Tensor a = a_.contiguous();
  const at::Tensor g = g_.contiguous();
  const at::Tensor grad = grad_.contiguous();
  if (a.dim() == 3) return ghost::norms_sq_3d_backward(grad, a, g, aux, bias, gram);
  const int64_t B = a.size(0), d_in = a.size(1), d_out = g.size(1);
  at::Tensor da = empty_contiguous_like(a);
  at::Tensor dg = empty_contiguous_like(g);
  TORCHFN_DISPATCH_FLOATS(a.scalar_type(), "torchfn::linear_grad_norms_sq_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* wp = grad.const_data_ptr<scalar_t>();
    const opmath_t* auxp = has_aux ? aux.const_data_ptr<opmath_t>() : nullptr;
    scalar_t* dap = da.mutable_data_ptr<scalar_t>();
    scalar_t* dgp = dg.mutable_data_ptr<scalar_t>();
    const opmath_t beta = bias ? opmath_t(1) : opmath_t(0);
    at::parallel_for(0, B, row_grain(d_in + d_out), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* ai = ap + i * d_in;
        const scalar_t* gi = gp + i * d_out;
        const opmath_t sa = auxp ? auxp[2 * i] : sum_sq(ai, d_in);
        const opmath_t sg = auxp ? auxp[2 * i + 1] : sum_sq(gi, d_out);
        const opmath_t two_w = opmath_t(2) * static_cast<opmath_t>(wp[i]);
        const opmath_t scale_a = two_w * sg;           // d/da = 2 w ||g||^2 a
        const opmath_t scale_g = two_w * (sa + beta);  // d/dg = 2 w (||a||^2 + bias) g
        scalar_t* dai = dap + i * d_in;
        scalar_t* dgi = dgp + i * d_out;
        for (int64_t k = 0; k < d_in; ++k) {
          dai[k] = static_cast<scalar_t>(static_cast<opmath_t>(ai[k]) * scale_a);
        }
        for (int64_t k = 0; k < d_out; ++k) {
          dgi[k] = static_cast<scalar_t>(static_cast<opmath_t>(gi[k]) * scale_g);
        }
      }
    });
  });
  return {da, dg};
}

at::Tensor clipped_linear_grad_sum_cpu(const at::Tensor& a, const at::Tensor& g,
                                       const at::Tensor& coef) {
  constexpr const char* op = "clipped_linear_grad_sum";
  ghost::check_pair(op, a, g, c10::DeviceType::CPU);
  ghost::check_per_sample(op, "coef", coef, a);
  return ghost::clipped_sum(a.contiguous(), g.contiguous(), coef.contiguous());
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CPU, m) {
  m.impl("linear_grad_norms_sq", &linear_grad_norms_sq_cpu);
  m.impl("linear_grad_norms_sq_backward", &linear_grad_norms_sq_backward_cpu);
  m.impl("clipped_linear_grad_sum", &clipped_linear_grad_sum_cpu);
}

}  // namespace torchfn
