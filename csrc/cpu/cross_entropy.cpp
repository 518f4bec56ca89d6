// CPU kernels of op 1: softmax cross-entropy with label smoothing and ignore_index.
//
// Per row i of logits x (N, C), target t_i, smoothing e, p = softmax(x_i), q = (1 - e) onehot(t_i)
// + e / C, and m_i = (t_i != ignore_index); with M_i = max_j x_ij and L_i = log sum_j
// exp(x_ij - M_i) (saved as stats (N, 2), so p = exp((x - M) - L) is exact like torch's):
//   forward          loss_i = m_i ((1 - e)(M_i - x_it) + e (M_i - mean_j x_ij) + L_i)
//   backward         dx_ij  = m_i g_i (p_ij - q_ij)
//   double backward  (w.r.t. g and x of the backward, applied to the cotangent v = gg_i)
//                    dg_i   = m_i <v_i, p_i - q_i>
//                    dx_ij  = m_i g_i p_ij (v_ij - <p_i, v_i>)
// Rows are split across threads with at::parallel_for; half/bfloat16 are computed in float
// (at::opmath_type), and per-row results (loss, stats, dg) are returned in that dtype. Ignored
// rows are skipped (loss 0, stats 0, zero gradients). Target values are checked on the host
// before any work: an index outside [0, C) that is not ignore_index raises.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../common.h"
#include "../cross_entropy.h"

namespace torchfn {
namespace {

constexpr int64_t kGrainElems = 32768;

inline int64_t row_grain(int64_t n_classes) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, n_classes));
}

at::Tensor empty_rows(const at::Tensor& logits, int64_t width = 0) {
  const auto opts = logits.options().dtype(at::toOpMathType(logits.scalar_type()));
  if (width == 0) return at::empty({logits.size(0)}, opts);
  return at::empty({logits.size(0), width}, opts);
}

std::tuple<at::Tensor, at::Tensor> xent_forward_cpu(const at::Tensor& logits_,
                                                    const at::Tensor& target_,
                                                    double label_smoothing,
                                                    int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy";
  xent::check_logits(op, logits_, c10::DeviceType::CPU);
  xent::check_target(op, target_, logits_);
  xent::check_smoothing(op, label_smoothing);
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  const int64_t n = x.size(0), c = x.size(1);
  xent::check_target_values(op, target, c, ignore_index);
  at::Tensor loss = empty_rows(x);
  at::Tensor stats = empty_rows(x, 2);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t eps = static_cast<opmath_t>(label_smoothing);
    const opmath_t hit = opmath_t(1) - eps;
    const opmath_t inv_c = opmath_t(1) / static_cast<opmath_t>(c);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    opmath_t* lossp = loss.mutable_data_ptr<opmath_t>();
    opmath_t* statp = stats.mutable_data_ptr<opmath_t>();
    at::parallel_for(0, n, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = tp[i];
        if (t == ignore_index) {
          lossp[i] = opmath_t(0);
          statp[2 * i] = statp[2 * i + 1] = opmath_t(0);
          continue;
        }
        const scalar_t* row = xp + i * c;
        opmath_t mx = -std::numeric_limits<opmath_t>::infinity();
        for (int64_t j = 0; j < c; ++j) mx = std::max(mx, static_cast<opmath_t>(row[j]));
        opmath_t sum = 0, sum_x = 0;
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t v = row[j];
          sum += std::exp(v - mx);
          sum_x += v;
        }
        const opmath_t log_sum = std::log(sum);
        opmath_t out = hit * (mx - static_cast<opmath_t>(row[t])) + log_sum;
        if (eps != opmath_t(0)) out += eps * (mx - sum_x * inv_c);
        lossp[i] = out;
        statp[2 * i] = mx;
        statp[2 * i + 1] = log_sum;
      }
    });
  });
  return {loss, stats};
}

at::Tensor xent_backward_cpu(const at::Tensor& grad_loss_, const at::Tensor& logits_,
                             const at::Tensor& target_, const at::Tensor& stats_,
                             double label_smoothing, int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy_backward";
  xent::check_logits(op, logits_, c10::DeviceType::CPU);
  xent::check_target(op, target_, logits_);
  xent::check_row_vector(op, "grad_loss", grad_loss_, logits_);
  xent::check_stats(op, stats_, logits_);
  xent::check_smoothing(op, label_smoothing);
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  const at::Tensor g = grad_loss_.contiguous();
  const at::Tensor stats = stats_.contiguous();
  const int64_t n = x.size(0), c = x.size(1);
  xent::check_target_values(op, target, c, ignore_index);
  at::Tensor dx = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t eps = static_cast<opmath_t>(label_smoothing);
    const opmath_t hit = opmath_t(1) - eps;
    const opmath_t eps_c = eps / static_cast<opmath_t>(c);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const opmath_t* gp = g.const_data_ptr<opmath_t>();
    const opmath_t* statp = stats.const_data_ptr<opmath_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* out = dp + i * c;
        const int64_t t = tp[i];
        if (t == ignore_index) {
          std::fill(out, out + c, scalar_t(0));
          continue;
        }
        const scalar_t* row = xp + i * c;
        const opmath_t gi = gp[i], mx = statp[2 * i], log_sum = statp[2 * i + 1];
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t p = std::exp((static_cast<opmath_t>(row[j]) - mx) - log_sum);
          opmath_t v = gi * (p - eps_c);
          if (j == t) v -= gi * hit;
          out[j] = static_cast<scalar_t>(v);
        }
      }
    });
  });
  return dx;
}

std::tuple<at::Tensor, at::Tensor> xent_double_backward_cpu(
    const at::Tensor& gg_, const at::Tensor& grad_loss_, const at::Tensor& logits_,
    const at::Tensor& target_, const at::Tensor& stats_, double label_smoothing,
    int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy_double_backward";
  xent::check_logits(op, logits_, c10::DeviceType::CPU);
  xent::check_target(op, target_, logits_);
  xent::check_row_vector(op, "grad_loss", grad_loss_, logits_);
  xent::check_stats(op, stats_, logits_);
  check_float_input(op, "grad_grad_logits", gg_, c10::DeviceType::CPU);
  check_same_as(op, "grad_grad_logits", gg_, "logits", logits_);
  xent::check_smoothing(op, label_smoothing);
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  const at::Tensor g = grad_loss_.contiguous();
  const at::Tensor stats = stats_.contiguous();
  const at::Tensor gg = gg_.contiguous();
  const int64_t n = x.size(0), c = x.size(1);
  xent::check_target_values(op, target, c, ignore_index);
  at::Tensor d_grad_loss = empty_rows(x);
  at::Tensor d_logits = empty_contiguous_like(x);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy_double_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t eps = static_cast<opmath_t>(label_smoothing);
    const opmath_t hit = opmath_t(1) - eps;
    const opmath_t eps_c = eps / static_cast<opmath_t>(c);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* vp = gg.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const opmath_t* gp = g.const_data_ptr<opmath_t>();
    const opmath_t* statp = stats.const_data_ptr<opmath_t>();
    opmath_t* dgp = d_grad_loss.mutable_data_ptr<opmath_t>();
    scalar_t* dxp = d_logits.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, row_grain(c), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> probs(static_cast<size_t>(c));
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* out = dxp + i * c;
        const int64_t t = tp[i];
        if (t == ignore_index) {
          dgp[i] = opmath_t(0);
          std::fill(out, out + c, scalar_t(0));
          continue;
        }
        const scalar_t* row = xp + i * c;
        const scalar_t* v = vp + i * c;
        const opmath_t mx = statp[2 * i], log_sum = statp[2 * i + 1];
        opmath_t dot = 0, sum_v = 0;
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t p = std::exp((static_cast<opmath_t>(row[j]) - mx) - log_sum);
          const opmath_t vj = v[j];
          probs[j] = p;
          dot += p * vj;
          sum_v += vj;
        }
        opmath_t dg = dot - hit * static_cast<opmath_t>(v[t]);
        if (eps != opmath_t(0)) dg -= eps_c * sum_v;  // <v, p - q>
        dgp[i] = dg;
        const opmath_t gi = gp[i];
        for (int64_t j = 0; j < c; ++j) {
          out[j] = static_cast<scalar_t>(gi * probs[j] * (static_cast<opmath_t>(v[j]) - dot));
        }
      }
    });
  });
  return {d_grad_loss, d_logits};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CPU, m) {
  m.impl("softmax_cross_entropy", &xent_forward_cpu);
  m.impl("softmax_cross_entropy_backward", &xent_backward_cpu);
  m.impl("softmax_cross_entropy_double_backward", &xent_double_backward_cpu);
}

}  // namespace torchfn
