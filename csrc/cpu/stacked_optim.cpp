// CPU kernels of op 4: fused Adam and SGD updates over stacked parameters `(N, ...)`, one
// leaf per call or a list of leaves per call (`*_multi`).
//
// One pass over the contiguous leaf, split across threads with at::parallel_for; each chunk
// walks member by member, so the per-member coefficients (lr, weight decay, bias corrections)
// are computed once per member and chunk. The arithmetic is in csrc/stacked_optim.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../stacked_optim.h"

namespace torchfn {
namespace {

constexpr int64_t kGrain = 16384;

using optim::AdamConsts;
using optim::AdamMember;
using optim::SgdConsts;
using optim::SgdMember;

// Calls body(m, begin, end) for each member-aligned run [begin, end) of [0, numel).
template <typename F>
void for_each_member_run(int64_t numel, int64_t inner, const F& body) {
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    while (i < end) {
      const int64_t m = i / inner;
      const int64_t stop = std::min(end, (m + 1) * inner);
      body(m, i, stop);
      i = stop;
    }
  });
}

// One member's run [begin, end) of Adam; the flags are template parameters, so the loop has
// no branches on them. (GCC does not vectorise it: std::sqrt may set errno, and the build
// does not pass -fno-math-errno; on CPU the pass is memory-bound either way.)
template <typename scalar_t, typename moment_t, bool HAS_P, bool L2, bool DECOUPLED, bool MAXIMIZE>
void adam_run(const scalar_t* __restrict__ gp, const moment_t* __restrict__ mp,
              const moment_t* __restrict__ vp, const scalar_t* __restrict__ pp,
              scalar_t* __restrict__ up, moment_t* __restrict__ mop, moment_t* __restrict__ vop,
              int64_t begin, int64_t end, AdamConsts<at::opmath_type<scalar_t>> k,
              AdamMember<at::opmath_type<scalar_t>> c) {
  using T = at::opmath_type<scalar_t>;
  k.l2 = L2;
  k.decoupled = DECOUPLED;
  k.maximize = MAXIMIZE;
  for (int64_t i = begin; i < end; ++i) {
    T u, mo, vo;
    const T p = HAS_P ? static_cast<T>(pp[i]) : T(0);
    optim::adam_elem<T>(k, c, static_cast<T>(gp[i]), static_cast<T>(mp[i]),
                        static_cast<T>(vp[i]), p, u, mo, vo);
    up[i] = static_cast<scalar_t>(u);
    mop[i] = static_cast<moment_t>(mo);
    vop[i] = static_cast<moment_t>(vo);
  }
}

template <typename scalar_t, typename moment_t>
void adam_cpu_typed(const at::Tensor& grad, const at::Tensor& mu, const at::Tensor& nu,
                    const at::Tensor* param, const at::Tensor& count, int64_t count_stride,
                    const at::Tensor& lr, int64_t lr_stride, const at::Tensor* wd,
                    int64_t wd_stride, const AdamConsts<at::opmath_type<scalar_t>>& k,
                    at::Tensor& upd, at::Tensor& mu_out, at::Tensor& nu_out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t numel = grad.numel();
  if (numel == 0) return;
  const int64_t inner = numel / grad.size(0);
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const moment_t* mp = mu.const_data_ptr<moment_t>();
  const moment_t* vp = nu.const_data_ptr<moment_t>();
  const scalar_t* pp = param != nullptr ? param->const_data_ptr<scalar_t>() : nullptr;
  const int64_t* cp = count.const_data_ptr<int64_t>();
  const T* lrp = lr.const_data_ptr<T>();
  const T* wdp = wd != nullptr ? wd->const_data_ptr<T>() : nullptr;
  scalar_t* up = upd.mutable_data_ptr<scalar_t>();
  moment_t* mop = mu_out.mutable_data_ptr<moment_t>();
  moment_t* vop = nu_out.mutable_data_ptr<moment_t>();
  // param is read only for weight decay (L2 or decoupled): 3 x 2 x 2 loop variants.
  using Run = void (*)(const scalar_t*, const moment_t*, const moment_t*, const scalar_t*,
                       scalar_t*, moment_t*, moment_t*, int64_t, int64_t, AdamConsts<T>,
                       AdamMember<T>);
  Run run;
  if (!k.l2 && !k.decoupled) {
    run = k.maximize ? &adam_run<scalar_t, moment_t, false, false, false, true>
                     : &adam_run<scalar_t, moment_t, false, false, false, false>;
  } else if (k.l2) {
    run = k.maximize ? &adam_run<scalar_t, moment_t, true, true, false, true>
                     : &adam_run<scalar_t, moment_t, true, true, false, false>;
  } else {
    run = k.maximize ? &adam_run<scalar_t, moment_t, true, false, true, true>
                     : &adam_run<scalar_t, moment_t, true, false, true, false>;
  }
  for_each_member_run(numel, inner, [&](int64_t m, int64_t begin, int64_t end) {
    const AdamMember<T> c =
        optim::adam_member<T>(k, lrp, lr_stride, wdp, wd_stride, cp, count_stride, m);
    run(gp, mp, vp, pp, up, mop, vop, begin, end, k, c);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stacked_adam_update_cpu(
    const at::Tensor& grad_, const at::Tensor& mu_, const at::Tensor& nu_,
    const std::optional<at::Tensor>& param_, const at::Tensor& count_, const at::Tensor& lr_,
    const std::optional<at::Tensor>& weight_decay_, double beta1, double beta2, double eps,
    double eps_root, bool decoupled, bool maximize) {
  constexpr const char* op = "stacked_adam_update";
  optim::check_grad_param(op, grad_, param_, weight_decay_, c10::DeviceType::CPU);
  optim::check_state(op, "mu", mu_, grad_);
  optim::check_state(op, "nu", nu_, grad_);
  TORCH_CHECK(mu_.scalar_type() == nu_.scalar_type(), "torchfn::", op,
              ": arguments 'mu' and 'nu' must have one dtype, got ", mu_.scalar_type(), " and ",
              nu_.scalar_type());
  const at::ScalarType opmath = optim::opmath_dtype(grad_.scalar_type());
  const int64_t lr_stride = optim::check_member_tensor(op, "lr", lr_, grad_, opmath);
  const int64_t wd_stride = weight_decay_.has_value() ? optim::check_member_tensor(
      op, "weight_decay", *weight_decay_, grad_, opmath) : 0;
  const int64_t count_stride = optim::check_count(op, count_, grad_);

  const at::Tensor grad = grad_.contiguous();
  const at::Tensor mu = mu_.contiguous();
  const at::Tensor nu = nu_.contiguous();
  const at::Tensor count = count_.contiguous();
  const at::Tensor lr = lr_.contiguous();
  std::optional<at::Tensor> param, wd;
  if (param_.has_value()) param = param_->contiguous();
  if (weight_decay_.has_value()) wd = weight_decay_->contiguous();
  at::Tensor upd = empty_contiguous_like(grad);
  at::Tensor mu_out = empty_contiguous_like(mu);
  at::Tensor nu_out = empty_contiguous_like(nu);

  TORCHFN_DISPATCH_FLOATS(grad.scalar_type(), "torchfn::stacked_adam_update", [&] {
    using T = at::opmath_type<scalar_t>;
    AdamConsts<T> k;
    k.b1 = static_cast<T>(beta1);
    k.omb1 = static_cast<T>(1.0 - beta1);
    k.b2 = static_cast<T>(beta2);
    k.omb2 = static_cast<T>(1.0 - beta2);
    k.eps = static_cast<T>(eps);
    k.eps_root = static_cast<T>(eps_root);
    k.b1d = beta1;
    k.b2d = beta2;
    k.l2 = wd.has_value() && !decoupled;
    k.decoupled = wd.has_value() && decoupled;
    k.maximize = maximize;
    const at::Tensor* pp = param.has_value() ? &*param : nullptr;
    const at::Tensor* wdp = wd.has_value() ? &*wd : nullptr;
    if (mu.scalar_type() == grad.scalar_type()) {
      adam_cpu_typed<scalar_t, scalar_t>(grad, mu, nu, pp, count, count_stride, lr, lr_stride,
                                         wdp, wd_stride, k, upd, mu_out, nu_out);
    } else {
      adam_cpu_typed<scalar_t, float>(grad, mu, nu, pp, count, count_stride, lr, lr_stride,
                                      wdp, wd_stride, k, upd, mu_out, nu_out);
    }
  });
  return {upd, mu_out, nu_out};
}

template <typename scalar_t, typename buf_t>
void sgd_cpu_typed(const at::Tensor& grad, const at::Tensor* buf, const at::Tensor* param,
                   const at::Tensor& count, int64_t count_stride, const at::Tensor& lr,
                   int64_t lr_stride, const at::Tensor* wd, int64_t wd_stride,
                   const SgdConsts<at::opmath_type<scalar_t>>& k, at::Tensor& upd,
                   at::Tensor* buf_out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t numel = grad.numel();
  if (numel == 0) return;
  const int64_t inner = numel / grad.size(0);
  const scalar_t* __restrict__ gp = grad.const_data_ptr<scalar_t>();
  const buf_t* __restrict__ bp = buf != nullptr ? buf->const_data_ptr<buf_t>() : nullptr;
  const scalar_t* __restrict__ pp = param != nullptr ? param->const_data_ptr<scalar_t>() : nullptr;
  const int64_t* cp = count.const_data_ptr<int64_t>();
  const T* lrp = lr.const_data_ptr<T>();
  const T* wdp = wd != nullptr ? wd->const_data_ptr<T>() : nullptr;
  scalar_t* __restrict__ up = upd.mutable_data_ptr<scalar_t>();
  buf_t* __restrict__ bop = buf_out != nullptr ? buf_out->mutable_data_ptr<buf_t>() : nullptr;
  for_each_member_run(numel, inner, [&](int64_t m, int64_t begin, int64_t end) {
    const SgdMember<T> c =
        optim::sgd_member<T>(lrp, lr_stride, wdp, wd_stride, cp, count_stride, m);
    for (int64_t i = begin; i < end; ++i) {
      T u, bo = T(0);
      const T p = pp != nullptr ? static_cast<T>(pp[i]) : T(0);
      const T b = bp != nullptr ? static_cast<T>(bp[i]) : T(0);
      optim::sgd_elem<T>(k, c, static_cast<T>(gp[i]), b, p, u, bo);
      up[i] = static_cast<scalar_t>(u);
      if (bop != nullptr) bop[i] = static_cast<buf_t>(bo);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> stacked_sgd_update_cpu(
    const at::Tensor& grad_, const std::optional<at::Tensor>& momentum_buffer_,
    const std::optional<at::Tensor>& param_, const at::Tensor& count_, const at::Tensor& lr_,
    const std::optional<at::Tensor>& weight_decay_, double momentum, double dampening,
    bool nesterov, bool maximize) {
  constexpr const char* op = "stacked_sgd_update";
  optim::check_grad_param(op, grad_, param_, weight_decay_, c10::DeviceType::CPU);
  if (momentum_buffer_.has_value()) {
    optim::check_state(op, "momentum_buffer", *momentum_buffer_, grad_);
  }
  const at::ScalarType opmath = optim::opmath_dtype(grad_.scalar_type());
  const int64_t lr_stride = optim::check_member_tensor(op, "lr", lr_, grad_, opmath);
  const int64_t wd_stride = weight_decay_.has_value() ? optim::check_member_tensor(
      op, "weight_decay", *weight_decay_, grad_, opmath) : 0;
  const int64_t count_stride = optim::check_count(op, count_, grad_);

  const at::Tensor grad = grad_.contiguous();
  const at::Tensor count = count_.contiguous();
  const at::Tensor lr = lr_.contiguous();
  std::optional<at::Tensor> buf, param, wd;
  if (momentum_buffer_.has_value()) buf = momentum_buffer_->contiguous();
  if (param_.has_value()) param = param_->contiguous();
  if (weight_decay_.has_value()) wd = weight_decay_->contiguous();
  at::Tensor upd = empty_contiguous_like(grad);
  // Without a momentum buffer the second output is an empty (0,) tensor of grad's dtype.
  at::Tensor buf_out = buf.has_value() ? empty_contiguous_like(*buf)
                                       : at::empty({0}, grad.options());

  TORCHFN_DISPATCH_FLOATS(grad.scalar_type(), "torchfn::stacked_sgd_update", [&] {
    using T = at::opmath_type<scalar_t>;
    SgdConsts<T> k;
    k.momentum = static_cast<T>(momentum);
    k.omd = static_cast<T>(1.0 - dampening);
    k.l2 = wd.has_value();
    k.has_buf = buf.has_value();
    k.nesterov = nesterov;
    k.maximize = maximize;
    const at::Tensor* bp = buf.has_value() ? &*buf : nullptr;
    const at::Tensor* pp = param.has_value() ? &*param : nullptr;
    const at::Tensor* wdp = wd.has_value() ? &*wd : nullptr;
    at::Tensor* bop = buf.has_value() ? &buf_out : nullptr;
    if (!buf.has_value() || buf->scalar_type() == grad.scalar_type()) {
      sgd_cpu_typed<scalar_t, scalar_t>(grad, bp, pp, count, count_stride, lr, lr_stride, wdp,
                                        wd_stride, k, upd, bop);
    } else {
      sgd_cpu_typed<scalar_t, float>(grad, bp, pp, count, count_stride, lr, lr_stride, wdp,
                                     wd_stride, k, upd, bop);
    }
  });
  return {upd, buf_out};
}

// The multi-leaf ops: on CPU one call that loops over the leaves (saving the per-leaf Python
// and dispatch overhead); the leaves share count, lr and weight_decay.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
stacked_adam_update_multi_cpu(at::TensorList grad, at::TensorList mu, at::TensorList nu,
                              at::TensorList param, const at::Tensor& count,
                              const at::Tensor& lr,
                              const std::optional<at::Tensor>& weight_decay, double beta1,
                              double beta2, double eps, double eps_root, bool decoupled,
                              bool maximize) {
  optim::check_multi_lists("stacked_adam_update_multi", grad, mu, "mu", nu, "nu", param,
                           weight_decay.has_value(), /*state_required=*/true);
  std::vector<at::Tensor> upd, mu_out, nu_out;
  for (size_t i = 0; i < grad.size(); ++i) {
    std::optional<at::Tensor> p;
    if (!param.empty()) p = param[i];
    auto out = stacked_adam_update_cpu(grad[i], mu[i], nu[i], p, count, lr, weight_decay,
                                       beta1, beta2, eps, eps_root, decoupled, maximize);
    upd.push_back(std::get<0>(out));
    mu_out.push_back(std::get<1>(out));
    nu_out.push_back(std::get<2>(out));
  }
  return {upd, mu_out, nu_out};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> stacked_sgd_update_multi_cpu(
    at::TensorList grad, at::TensorList momentum_buffer, at::TensorList param,
    const at::Tensor& count, const at::Tensor& lr, const std::optional<at::Tensor>& weight_decay,
    double momentum, double dampening, bool nesterov, bool maximize) {
  optim::check_multi_lists("stacked_sgd_update_multi", grad, momentum_buffer,
                           "momentum_buffer", {}, nullptr, param, weight_decay.has_value(),
                           /*state_required=*/false);
  std::vector<at::Tensor> upd, buf_out;
  for (size_t i = 0; i < grad.size(); ++i) {
    std::optional<at::Tensor> b, p;
    if (!momentum_buffer.empty()) b = momentum_buffer[i];
    if (!param.empty()) p = param[i];
    auto out = stacked_sgd_update_cpu(grad[i], b, p, count, lr, weight_decay, momentum,
                                      dampening, nesterov, maximize);
    upd.push_back(std::get<0>(out));
    if (b.has_value()) buf_out.push_back(std::get<1>(out));
  }
  return {upd, buf_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CPU, m) {
  m.impl("stacked_adam_update", &stacked_adam_update_cpu);
  m.impl("stacked_sgd_update", &stacked_sgd_update_cpu);
  m.impl("stacked_adam_update_multi", &stacked_adam_update_multi_cpu);
  m.impl("stacked_sgd_update_multi", &stacked_sgd_update_multi_cpu);
}

}  // namespace torchfn
