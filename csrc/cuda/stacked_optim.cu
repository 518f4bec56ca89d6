// CUDA kernels of op 4: fused Adam and SGD updates over stacked parameters `(N, ...)`.
//
// One grid-stride pass over all elements of the leaf; the member of an element is derived
// from its flat index (`i / inner`, in 32-bit arithmetic when the leaf has < 2^31 elements)
// and each thread caches the coefficients of the member it last touched (lr, weight decay,
// bias corrections from the on-device step count), so they are recomputed only when a thread
// crosses into another member. When every member's row is a whole number of 16-byte packs
// (inner % VEC == 0) and all pointers are 16-byte aligned, each thread moves one pack per
// tensor per iteration (float4 for float32, double2 for float64; 4 elements for bfloat16
// parameters with float32 moments); otherwise a scalar loop. The arithmetic is in
// csrc/stacked_optim.h, shared with the CPU kernels.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../stacked_optim.h"
#include "elementwise.cuh"

namespace torchfn {
namespace {

using cuda::Pack;
using optim::AdamConsts;
using optim::AdamMember;
using optim::SgdConsts;
using optim::SgdMember;

template <typename scalar_t, typename moment_t, int VEC, typename index_t>
__global__ void adam_kernel(const scalar_t* __restrict__ grad, const moment_t* __restrict__ mu,
                            const moment_t* __restrict__ nu, const scalar_t* __restrict__ param,
                            const int64_t* __restrict__ count, int64_t count_stride,
                            const at::opmath_type<scalar_t>* __restrict__ lr, int64_t lr_stride,
                            const at::opmath_type<scalar_t>* __restrict__ wd, int64_t wd_stride,
                            scalar_t* __restrict__ upd, moment_t* __restrict__ mu_out,
                            moment_t* __restrict__ nu_out, index_t n_packs, index_t inner,
                            AdamConsts<at::opmath_type<scalar_t>> k) {
  using T = at::opmath_type<scalar_t>;
  using PS = Pack<scalar_t, VEC>;
  using PM = Pack<moment_t, VEC>;
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  index_t cached = static_cast<index_t>(-1);
  AdamMember<T> c{};
  for (index_t q = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < n_packs;
       q += stride) {
    const index_t m = (q * VEC) / inner;  // all VEC elements of the pack share one member
    if (m != cached) {
      c = optim::adam_member<T>(k, lr, lr_stride, wd, wd_stride, count, count_stride,
                                static_cast<int64_t>(m));
      cached = m;
    }
    const PS g = reinterpret_cast<const PS*>(grad)[q];
    const PM a = reinterpret_cast<const PM*>(mu)[q];
    const PM b = reinterpret_cast<const PM*>(nu)[q];
    PS p;
    if (param != nullptr) {
      p = reinterpret_cast<const PS*>(param)[q];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) p.v[j] = scalar_t(0);
    }
    PS u;
    PM mo, vo;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      T uj, mj, vj;
      optim::adam_elem<T>(k, c, static_cast<T>(g.v[j]), static_cast<T>(a.v[j]),
                          static_cast<T>(b.v[j]), static_cast<T>(p.v[j]), uj, mj, vj);
      u.v[j] = static_cast<scalar_t>(uj);
      mo.v[j] = static_cast<moment_t>(mj);
      vo.v[j] = static_cast<moment_t>(vj);
    }
    reinterpret_cast<PS*>(upd)[q] = u;
    reinterpret_cast<PM*>(mu_out)[q] = mo;
    reinterpret_cast<PM*>(nu_out)[q] = vo;
  }
}

template <typename scalar_t, typename buf_t, int VEC, typename index_t>
__global__ void sgd_kernel(const scalar_t* __restrict__ grad, const buf_t* __restrict__ buf,
                           const scalar_t* __restrict__ param,
                           const int64_t* __restrict__ count, int64_t count_stride,
                           const at::opmath_type<scalar_t>* __restrict__ lr, int64_t lr_stride,
                           const at::opmath_type<scalar_t>* __restrict__ wd, int64_t wd_stride,
                           scalar_t* __restrict__ upd, buf_t* __restrict__ buf_out,
                           index_t n_packs, index_t inner, SgdConsts<at::opmath_type<scalar_t>> k) {
  using T = at::opmath_type<scalar_t>;
  using PS = Pack<scalar_t, VEC>;
  using PB = Pack<buf_t, VEC>;
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  index_t cached = static_cast<index_t>(-1);
  SgdMember<T> c{};
  for (index_t q = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < n_packs;
       q += stride) {
    const index_t m = (q * VEC) / inner;
    if (m != cached) {
      c = optim::sgd_member<T>(lr, lr_stride, wd, wd_stride, count, count_stride,
                               static_cast<int64_t>(m));
      cached = m;
    }
    const PS g = reinterpret_cast<const PS*>(grad)[q];
    PS p;
    PB b;
    if (param != nullptr) {
      p = reinterpret_cast<const PS*>(param)[q];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) p.v[j] = scalar_t(0);
    }
    if (buf != nullptr) {
      b = reinterpret_cast<const PB*>(buf)[q];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) b.v[j] = buf_t(0);
    }
    PS u;
    PB bo;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      T uj, bj = T(0);
      optim::sgd_elem<T>(k, c, static_cast<T>(g.v[j]), static_cast<T>(b.v[j]),
                         static_cast<T>(p.v[j]), uj, bj);
      u.v[j] = static_cast<scalar_t>(uj);
      bo.v[j] = static_cast<buf_t>(bj);
    }
    reinterpret_cast<PS*>(upd)[q] = u;
    if (buf_out != nullptr) reinterpret_cast<PB*>(buf_out)[q] = bo;
  }
}

template <typename A, typename B>
struct WideVec {  // elements per 16-byte pack of the wider of the two dtypes
  static constexpr int value = 16 / (sizeof(A) > sizeof(B) ? sizeof(A) : sizeof(B));
};

inline bool aligned_to(const void* p, int64_t bytes) {
  return p == nullptr || (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

// The launch shape: packs of VEC elements when every member's row is a whole number of
// 16-byte packs and the pointers are aligned (else single elements), 32-bit index math when
// the leaf has fewer than 2^31 elements.
struct LaunchShape {
  bool vec, small;
  int64_t n_packs, blocks;
};

inline LaunchShape launch_shape(int64_t numel, int64_t inner, int vec_width, bool aligned) {
  LaunchShape s;
  s.vec = aligned && inner % vec_width == 0;
  s.small = numel < (int64_t(1) << 31);
  s.n_packs = s.vec ? numel / vec_width : numel;
  s.blocks = cuda::grid_for(s.n_packs);
  return s;
}

template <typename scalar_t, typename moment_t>
void adam_cuda_typed(const at::Tensor& grad, const at::Tensor& mu, const at::Tensor& nu,
                     const at::Tensor* param, const at::Tensor& count, int64_t count_stride,
                     const at::Tensor& lr, int64_t lr_stride, const at::Tensor* wd,
                     int64_t wd_stride, const AdamConsts<at::opmath_type<scalar_t>>& k,
                     at::Tensor& upd, at::Tensor& mu_out, at::Tensor& nu_out) {
  using T = at::opmath_type<scalar_t>;
  constexpr int VEC = WideVec<scalar_t, moment_t>::value;
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
  constexpr int64_t sb = VEC * sizeof(scalar_t), mb = VEC * sizeof(moment_t);
  const bool aligned = aligned_to(gp, sb) && aligned_to(pp, sb) && aligned_to(up, sb) &&
                       aligned_to(mp, mb) && aligned_to(vp, mb) && aligned_to(mop, mb) &&
                       aligned_to(vop, mb);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const LaunchShape ls = launch_shape(numel, inner, VEC, aligned);
#define TORCHFN_ADAM_LAUNCH(V, index_t)                                                   \
  adam_kernel<scalar_t, moment_t, V, index_t><<<ls.blocks, cuda::kThreads, 0, stream>>>( \
      gp, mp, vp, pp, cp, count_stride, lrp, lr_stride, wdp, wd_stride, up, mop, vop,    \
      static_cast<index_t>(ls.n_packs), static_cast<index_t>(inner), k)
  if (ls.vec && ls.small) {
    TORCHFN_ADAM_LAUNCH(VEC, uint32_t);
  } else if (ls.vec) {
    TORCHFN_ADAM_LAUNCH(VEC, uint64_t);
  } else if (ls.small) {
    TORCHFN_ADAM_LAUNCH(1, uint32_t);
  } else {
    TORCHFN_ADAM_LAUNCH(1, uint64_t);
  }
#undef TORCHFN_ADAM_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stacked_adam_update_cuda(
    const at::Tensor& grad_, const at::Tensor& mu_, const at::Tensor& nu_,
    const std::optional<at::Tensor>& param_, const at::Tensor& count_, const at::Tensor& lr_,
    const std::optional<at::Tensor>& weight_decay_, double beta1, double beta2, double eps,
    double eps_root, bool decoupled, bool maximize) {
  constexpr const char* op = "stacked_adam_update";
  optim::check_grad_param(op, grad_, param_, weight_decay_, c10::DeviceType::CUDA);
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
  const c10::cuda::CUDAGuard guard(grad_.device());

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
      adam_cuda_typed<scalar_t, scalar_t>(grad, mu, nu, pp, count, count_stride, lr, lr_stride,
                                          wdp, wd_stride, k, upd, mu_out, nu_out);
    } else {
      adam_cuda_typed<scalar_t, float>(grad, mu, nu, pp, count, count_stride, lr, lr_stride,
                                       wdp, wd_stride, k, upd, mu_out, nu_out);
    }
  });
  return {upd, mu_out, nu_out};
}

template <typename scalar_t, typename buf_t>
void sgd_cuda_typed(const at::Tensor& grad, const at::Tensor* buf, const at::Tensor* param,
                    const at::Tensor& count, int64_t count_stride, const at::Tensor& lr,
                    int64_t lr_stride, const at::Tensor* wd, int64_t wd_stride,
                    const SgdConsts<at::opmath_type<scalar_t>>& k, at::Tensor& upd,
                    at::Tensor* buf_out) {
  using T = at::opmath_type<scalar_t>;
  constexpr int VEC = WideVec<scalar_t, buf_t>::value;
  const int64_t numel = grad.numel();
  if (numel == 0) return;
  const int64_t inner = numel / grad.size(0);
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const buf_t* bp = buf != nullptr ? buf->const_data_ptr<buf_t>() : nullptr;
  const scalar_t* pp = param != nullptr ? param->const_data_ptr<scalar_t>() : nullptr;
  const int64_t* cp = count.const_data_ptr<int64_t>();
  const T* lrp = lr.const_data_ptr<T>();
  const T* wdp = wd != nullptr ? wd->const_data_ptr<T>() : nullptr;
  scalar_t* up = upd.mutable_data_ptr<scalar_t>();
  buf_t* bop = buf_out != nullptr ? buf_out->mutable_data_ptr<buf_t>() : nullptr;
  constexpr int64_t sb = VEC * sizeof(scalar_t), bb = VEC * sizeof(buf_t);
  const bool aligned = aligned_to(gp, sb) && aligned_to(pp, sb) && aligned_to(up, sb) &&
                       aligned_to(bp, bb) && aligned_to(bop, bb);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const LaunchShape ls = launch_shape(numel, inner, VEC, aligned);
#define TORCHFN_SGD_LAUNCH(V, index_t)                                                   \
  sgd_kernel<scalar_t, buf_t, V, index_t><<<ls.blocks, cuda::kThreads, 0, stream>>>(    \
      gp, bp, pp, cp, count_stride, lrp, lr_stride, wdp, wd_stride, up, bop,            \
      static_cast<index_t>(ls.n_packs), static_cast<index_t>(inner), k)
  if (ls.vec && ls.small) {
    TORCHFN_SGD_LAUNCH(VEC, uint32_t);
  } else if (ls.vec) {
    TORCHFN_SGD_LAUNCH(VEC, uint64_t);
  } else if (ls.small) {
    TORCHFN_SGD_LAUNCH(1, uint32_t);
  } else {
    TORCHFN_SGD_LAUNCH(1, uint64_t);
  }
#undef TORCHFN_SGD_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> stacked_sgd_update_cuda(
    const at::Tensor& grad_, const std::optional<at::Tensor>& momentum_buffer_,
    const std::optional<at::Tensor>& param_, const at::Tensor& count_, const at::Tensor& lr_,
    const std::optional<at::Tensor>& weight_decay_, double momentum, double dampening,
    bool nesterov, bool maximize) {
  constexpr const char* op = "stacked_sgd_update";
  optim::check_grad_param(op, grad_, param_, weight_decay_, c10::DeviceType::CUDA);
  if (momentum_buffer_.has_value()) {
    optim::check_state(op, "momentum_buffer", *momentum_buffer_, grad_);
  }
  const at::ScalarType opmath = optim::opmath_dtype(grad_.scalar_type());
  const int64_t lr_stride = optim::check_member_tensor(op, "lr", lr_, grad_, opmath);
  const int64_t wd_stride = weight_decay_.has_value() ? optim::check_member_tensor(
      op, "weight_decay", *weight_decay_, grad_, opmath) : 0;
  const int64_t count_stride = optim::check_count(op, count_, grad_);
  const c10::cuda::CUDAGuard guard(grad_.device());

  const at::Tensor grad = grad_.contiguous();
  const at::Tensor count = count_.contiguous();
  const at::Tensor lr = lr_.contiguous();
  std::optional<at::Tensor> buf, param, wd;
  if (momentum_buffer_.has_value()) buf = momentum_buffer_->contiguous();
  if (param_.has_value()) param = param_->contiguous();
  if (weight_decay_.has_value()) wd = weight_decay_->contiguous();
  at::Tensor upd = empty_contiguous_like(grad);
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
      sgd_cuda_typed<scalar_t, scalar_t>(grad, bp, pp, count, count_stride, lr, lr_stride, wdp,
                                         wd_stride, k, upd, bop);
    } else {
      sgd_cuda_typed<scalar_t, float>(grad, bp, pp, count, count_stride, lr, lr_stride, wdp,
                                      wd_stride, k, upd, bop);
    }
  });
  return {upd, buf_out};
}

// ---------------------------------------------------------------------------------------
// Multi-leaf kernels: one launch updates up to kMaxLeaves leaves. The leaves' pointers travel
// in the kernel arguments; the work units (16-byte packs of a leaf whose rows are whole packs
// and whose pointers are aligned, else single elements) of all leaves are numbered one after
// the other, and each thread walks its units in a grid-stride loop, advancing through the
// leaf table as it goes. Member coefficients depend only on the member (count, lr and
// weight_decay are shared by the leaves), so the per-thread cache spans leaves.

constexpr int kMaxLeaves = 24;

template <typename scalar_t, typename moment_t>
struct AdamTable {
  const scalar_t* grad[kMaxLeaves];
  const moment_t* mu[kMaxLeaves];
  const moment_t* nu[kMaxLeaves];
  const scalar_t* param[kMaxLeaves];
  scalar_t* upd[kMaxLeaves];
  moment_t* mu_out[kMaxLeaves];
  moment_t* nu_out[kMaxLeaves];
  int64_t inner[kMaxLeaves];
  int64_t start[kMaxLeaves + 1];  // first unit of each leaf; start[n] = total units
  bool vec[kMaxLeaves];
  int n;
};

template <typename scalar_t, typename buf_t>
struct SgdTable {
  const scalar_t* grad[kMaxLeaves];
  const buf_t* buf[kMaxLeaves];
  const scalar_t* param[kMaxLeaves];
  scalar_t* upd[kMaxLeaves];
  buf_t* buf_out[kMaxLeaves];
  int64_t inner[kMaxLeaves];
  int64_t start[kMaxLeaves + 1];
  bool vec[kMaxLeaves];
  int n;
};

template <typename scalar_t, typename moment_t, int V>
__device__ __forceinline__ void adam_unit(const AdamTable<scalar_t, moment_t>& t, int l,
                                          int64_t u, const AdamConsts<at::opmath_type<scalar_t>>& k,
                                          const AdamMember<at::opmath_type<scalar_t>>& c) {
  using T = at::opmath_type<scalar_t>;
  using PS = Pack<scalar_t, V>;
  using PM = Pack<moment_t, V>;
  const PS g = reinterpret_cast<const PS*>(t.grad[l])[u];
  const PM a = reinterpret_cast<const PM*>(t.mu[l])[u];
  const PM b = reinterpret_cast<const PM*>(t.nu[l])[u];
  PS p;
  if (t.param[l] != nullptr) {
    p = reinterpret_cast<const PS*>(t.param[l])[u];
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = scalar_t(0);
  }
  PS out;
  PM mo, vo;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    T uj, mj, vj;
    optim::adam_elem<T>(k, c, static_cast<T>(g.v[j]), static_cast<T>(a.v[j]),
                        static_cast<T>(b.v[j]), static_cast<T>(p.v[j]), uj, mj, vj);
    out.v[j] = static_cast<scalar_t>(uj);
    mo.v[j] = static_cast<moment_t>(mj);
    vo.v[j] = static_cast<moment_t>(vj);
  }
  reinterpret_cast<PS*>(t.upd[l])[u] = out;
  reinterpret_cast<PM*>(t.mu_out[l])[u] = mo;
  reinterpret_cast<PM*>(t.nu_out[l])[u] = vo;
}

template <typename scalar_t, typename moment_t, int VEC>
__global__ void adam_multi_kernel(const __grid_constant__ AdamTable<scalar_t, moment_t> t,
                                  const int64_t* __restrict__ count, int64_t count_stride,
                                  const at::opmath_type<scalar_t>* __restrict__ lr,
                                  int64_t lr_stride,
                                  const at::opmath_type<scalar_t>* __restrict__ wd,
                                  int64_t wd_stride, AdamConsts<at::opmath_type<scalar_t>> k) {
  using T = at::opmath_type<scalar_t>;
  const int64_t total = t.start[t.n];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int l = 0;
  int64_t cached = -1;
  AdamMember<T> c{};
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < total;
       q += stride) {
    while (q >= t.start[l + 1]) ++l;
    const int64_t u = q - t.start[l];
    const bool vec = t.vec[l];
    const int64_t m = (vec ? u * VEC : u) / t.inner[l];
    if (m != cached) {
      c = optim::adam_member<T>(k, lr, lr_stride, wd, wd_stride, count, count_stride, m);
      cached = m;
    }
    if (vec) {
      adam_unit<scalar_t, moment_t, VEC>(t, l, u, k, c);
    } else {
      adam_unit<scalar_t, moment_t, 1>(t, l, u, k, c);
    }
  }
}

template <typename scalar_t, typename buf_t, int V>
__device__ __forceinline__ void sgd_unit(const SgdTable<scalar_t, buf_t>& t, int l, int64_t u,
                                         const SgdConsts<at::opmath_type<scalar_t>>& k,
                                         const SgdMember<at::opmath_type<scalar_t>>& c) {
  using T = at::opmath_type<scalar_t>;
  using PS = Pack<scalar_t, V>;
  using PB = Pack<buf_t, V>;
  const PS g = reinterpret_cast<const PS*>(t.grad[l])[u];
  PS p;
  PB b;
  if (t.param[l] != nullptr) {
    p = reinterpret_cast<const PS*>(t.param[l])[u];
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = scalar_t(0);
  }
  if (t.buf[l] != nullptr) {
    b = reinterpret_cast<const PB*>(t.buf[l])[u];
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) b.v[j] = buf_t(0);
  }
  PS out;
  PB bo;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    T uj, bj = T(0);
    optim::sgd_elem<T>(k, c, static_cast<T>(g.v[j]), static_cast<T>(b.v[j]),
                       static_cast<T>(p.v[j]), uj, bj);
    out.v[j] = static_cast<scalar_t>(uj);
    bo.v[j] = static_cast<buf_t>(bj);
  }
  reinterpret_cast<PS*>(t.upd[l])[u] = out;
  if (t.buf_out[l] != nullptr) reinterpret_cast<PB*>(t.buf_out[l])[u] = bo;
}

template <typename scalar_t, typename buf_t, int VEC>
__global__ void sgd_multi_kernel(const __grid_constant__ SgdTable<scalar_t, buf_t> t,
                                 const int64_t* __restrict__ count, int64_t count_stride,
                                 const at::opmath_type<scalar_t>* __restrict__ lr,
                                 int64_t lr_stride,
                                 const at::opmath_type<scalar_t>* __restrict__ wd,
                                 int64_t wd_stride, SgdConsts<at::opmath_type<scalar_t>> k) {
  using T = at::opmath_type<scalar_t>;
  const int64_t total = t.start[t.n];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int l = 0;
  int64_t cached = -1;
  SgdMember<T> c{};
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < total;
       q += stride) {
    while (q >= t.start[l + 1]) ++l;
    const int64_t u = q - t.start[l];
    const bool vec = t.vec[l];
    const int64_t m = (vec ? u * VEC : u) / t.inner[l];
    if (m != cached) {
      c = optim::sgd_member<T>(lr, lr_stride, wd, wd_stride, count, count_stride, m);
      cached = m;
    }
    if (vec) {
      sgd_unit<scalar_t, buf_t, VEC>(t, l, u, k, c);
    } else {
      sgd_unit<scalar_t, buf_t, 1>(t, l, u, k, c);
    }
  }
}

// Checks shared by the multi-leaf CUDA ops: every leaf has the dtype of the first (one kernel
// instantiation per launch) and its state the dtype of the first leaf's state.
inline void check_uniform_dtypes(const char* op, at::TensorList grad, at::TensorList state,
                                 const char* state_arg) {
  for (size_t i = 1; i < grad.size(); ++i) {
    TORCH_CHECK(grad[i].scalar_type() == grad[0].scalar_type(), "torchfn::", op,
                ": every leaf of 'grad' must have one dtype on CUDA, got ",
                grad[0].scalar_type(), " (leaf 0) and ", grad[i].scalar_type(), " (leaf ",
                std::to_string(i), ")");
    if (!state.empty()) {
      TORCH_CHECK(state[i].scalar_type() == state[0].scalar_type(), "torchfn::", op,
                  ": every leaf of '", state_arg, "' must have one dtype on CUDA, got ",
                  state[0].scalar_type(), " (leaf 0) and ", state[i].scalar_type(), " (leaf ",
                  std::to_string(i), ")");
    }
  }
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
stacked_adam_update_multi_cuda(at::TensorList grad_, at::TensorList mu_, at::TensorList nu_,
                               at::TensorList param_, const at::Tensor& count_,
                               const at::Tensor& lr_,
                               const std::optional<at::Tensor>& weight_decay_, double beta1,
                               double beta2, double eps, double eps_root, bool decoupled,
                               bool maximize) {
  constexpr const char* op = "stacked_adam_update_multi";
  const bool has_wd = weight_decay_.has_value();
  optim::check_multi_lists(op, grad_, mu_, "mu", nu_, "nu", param_, has_wd, true);
  std::vector<at::Tensor> upd, mu_out, nu_out;
  if (grad_.empty()) return {upd, mu_out, nu_out};
  check_uniform_dtypes(op, grad_, mu_, "mu");
  int64_t lr_stride = 0, wd_stride = 0, count_stride = 0;
  std::vector<at::Tensor> grad, mu, nu, param;  // contiguous inputs, alive until the launch
  for (size_t i = 0; i < grad_.size(); ++i) {
    std::optional<at::Tensor> p;
    if (has_wd) p = param_[i];
    optim::check_grad_param(op, grad_[i], p, weight_decay_, c10::DeviceType::CUDA);
    optim::check_state(op, "mu", mu_[i], grad_[i]);
    optim::check_state(op, "nu", nu_[i], grad_[i]);
    TORCH_CHECK(nu_[i].scalar_type() == mu_[i].scalar_type(), "torchfn::", op,
                ": arguments 'mu' and 'nu' must have one dtype, got ", mu_[i].scalar_type(),
                " and ", nu_[i].scalar_type());
    const at::ScalarType opmath = optim::opmath_dtype(grad_[i].scalar_type());
    lr_stride = optim::check_member_tensor(op, "lr", lr_, grad_[i], opmath);
    if (has_wd) {
      wd_stride = optim::check_member_tensor(op, "weight_decay", *weight_decay_, grad_[i],
                                             opmath);
    }
    count_stride = optim::check_count(op, count_, grad_[i]);
    TORCH_CHECK(grad_[i].device() == grad_[0].device(), "torchfn::", op,
                ": every leaf must be on one device, got ", grad_[0].device(), " and ",
                grad_[i].device());
    grad.push_back(grad_[i].contiguous());
    mu.push_back(mu_[i].contiguous());
    nu.push_back(nu_[i].contiguous());
    if (has_wd) param.push_back(param_[i].contiguous());
    upd.push_back(empty_contiguous_like(grad.back()));
    mu_out.push_back(empty_contiguous_like(mu.back()));
    nu_out.push_back(empty_contiguous_like(nu.back()));
  }
  const c10::cuda::CUDAGuard guard(grad_[0].device());
  const at::Tensor count = count_.contiguous();
  const at::Tensor lr = lr_.contiguous();
  std::optional<at::Tensor> wd;
  if (has_wd) wd = weight_decay_->contiguous();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  TORCHFN_DISPATCH_FLOATS(grad[0].scalar_type(), "torchfn::stacked_adam_update_multi", [&] {
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
    k.l2 = has_wd && !decoupled;
    k.decoupled = has_wd && decoupled;
    k.maximize = maximize;
    const T* lrp = lr.const_data_ptr<T>();
    const T* wdp = has_wd ? wd->const_data_ptr<T>() : nullptr;
    const int64_t* cp = count.const_data_ptr<int64_t>();
    auto launch = [&](auto moment_tag) {
      using moment_t = decltype(moment_tag);
      constexpr int VEC = WideVec<scalar_t, moment_t>::value;
      constexpr int64_t sb = VEC * sizeof(scalar_t), mb = VEC * sizeof(moment_t);
      for (size_t first = 0; first < grad.size(); first += kMaxLeaves) {
        AdamTable<scalar_t, moment_t> t{};
        int64_t total = 0;
        t.n = 0;
        for (size_t i = first; i < grad.size() && t.n < kMaxLeaves; ++i, ++t.n) {
          const int j = t.n;
          t.grad[j] = grad[i].const_data_ptr<scalar_t>();
          t.mu[j] = mu[i].const_data_ptr<moment_t>();
          t.nu[j] = nu[i].const_data_ptr<moment_t>();
          t.param[j] = has_wd ? param[i].const_data_ptr<scalar_t>() : nullptr;
          t.upd[j] = upd[i].mutable_data_ptr<scalar_t>();
          t.mu_out[j] = mu_out[i].mutable_data_ptr<moment_t>();
          t.nu_out[j] = nu_out[i].mutable_data_ptr<moment_t>();
          const int64_t numel = grad[i].numel();
          t.inner[j] = numel > 0 ? numel / grad[i].size(0) : 1;
          t.vec[j] = t.inner[j] % VEC == 0 && aligned_to(t.grad[j], sb) &&
                     aligned_to(t.param[j], sb) && aligned_to(t.upd[j], sb) &&
                     aligned_to(t.mu[j], mb) && aligned_to(t.nu[j], mb) &&
                     aligned_to(t.mu_out[j], mb) && aligned_to(t.nu_out[j], mb);
          t.start[j] = total;
          total += t.vec[j] ? numel / VEC : numel;
        }
        t.start[t.n] = total;
        if (total == 0) continue;
        adam_multi_kernel<scalar_t, moment_t, VEC>
            <<<cuda::grid_for(total), cuda::kThreads, 0, stream>>>(
                t, cp, count_stride, lrp, lr_stride, wdp, wd_stride, k);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    if (mu[0].scalar_type() == grad[0].scalar_type()) {
      launch(scalar_t{});
    } else {
      launch(float{});
    }
  });
  return {upd, mu_out, nu_out};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> stacked_sgd_update_multi_cuda(
    at::TensorList grad_, at::TensorList buf_, at::TensorList param_, const at::Tensor& count_,
    const at::Tensor& lr_, const std::optional<at::Tensor>& weight_decay_, double momentum,
    double dampening, bool nesterov, bool maximize) {
  constexpr const char* op = "stacked_sgd_update_multi";
  const bool has_wd = weight_decay_.has_value();
  const bool has_buf = !buf_.empty();
  optim::check_multi_lists(op, grad_, buf_, "momentum_buffer", {}, nullptr, param_, has_wd,
                           false);
  std::vector<at::Tensor> upd, buf_out;
  if (grad_.empty()) return {upd, buf_out};
  check_uniform_dtypes(op, grad_, buf_, "momentum_buffer");
  int64_t lr_stride = 0, wd_stride = 0, count_stride = 0;
  std::vector<at::Tensor> grad, buf, param;
  for (size_t i = 0; i < grad_.size(); ++i) {
    std::optional<at::Tensor> p;
    if (has_wd) p = param_[i];
    optim::check_grad_param(op, grad_[i], p, weight_decay_, c10::DeviceType::CUDA);
    if (has_buf) optim::check_state(op, "momentum_buffer", buf_[i], grad_[i]);
    const at::ScalarType opmath = optim::opmath_dtype(grad_[i].scalar_type());
    lr_stride = optim::check_member_tensor(op, "lr", lr_, grad_[i], opmath);
    if (has_wd) {
      wd_stride = optim::check_member_tensor(op, "weight_decay", *weight_decay_, grad_[i],
                                             opmath);
    }
    count_stride = optim::check_count(op, count_, grad_[i]);
    TORCH_CHECK(grad_[i].device() == grad_[0].device(), "torchfn::", op,
                ": every leaf must be on one device, got ", grad_[0].device(), " and ",
                grad_[i].device());
    grad.push_back(grad_[i].contiguous());
    if (has_buf) buf.push_back(buf_[i].contiguous());
    if (has_wd) param.push_back(param_[i].contiguous());
    upd.push_back(empty_contiguous_like(grad.back()));
    if (has_buf) buf_out.push_back(empty_contiguous_like(buf.back()));
  }
  const c10::cuda::CUDAGuard guard(grad_[0].device());
  const at::Tensor count = count_.contiguous();
  const at::Tensor lr = lr_.contiguous();
  std::optional<at::Tensor> wd;
  if (has_wd) wd = weight_decay_->contiguous();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  TORCHFN_DISPATCH_FLOATS(grad[0].scalar_type(), "torchfn::stacked_sgd_update_multi", [&] {
    using T = at::opmath_type<scalar_t>;
    SgdConsts<T> k;
    k.momentum = static_cast<T>(momentum);
    k.omd = static_cast<T>(1.0 - dampening);
    k.l2 = has_wd;
    k.has_buf = has_buf;
    k.nesterov = nesterov;
    k.maximize = maximize;
    const T* lrp = lr.const_data_ptr<T>();
    const T* wdp = has_wd ? wd->const_data_ptr<T>() : nullptr;
    const int64_t* cp = count.const_data_ptr<int64_t>();
    auto launch = [&](auto buf_tag) {
      using buf_t = decltype(buf_tag);
      constexpr int VEC = WideVec<scalar_t, buf_t>::value;
      constexpr int64_t sb = VEC * sizeof(scalar_t), bb = VEC * sizeof(buf_t);
      for (size_t first = 0; first < grad.size(); first += kMaxLeaves) {
        SgdTable<scalar_t, buf_t> t{};
        int64_t total = 0;
        t.n = 0;
        for (size_t i = first; i < grad.size() && t.n < kMaxLeaves; ++i, ++t.n) {
          const int j = t.n;
          t.grad[j] = grad[i].const_data_ptr<scalar_t>();
          t.buf[j] = has_buf ? buf[i].const_data_ptr<buf_t>() : nullptr;
          t.param[j] = has_wd ? param[i].const_data_ptr<scalar_t>() : nullptr;
          t.upd[j] = upd[i].mutable_data_ptr<scalar_t>();
          t.buf_out[j] = has_buf ? buf_out[i].mutable_data_ptr<buf_t>() : nullptr;
          const int64_t numel = grad[i].numel();
          t.inner[j] = numel > 0 ? numel / grad[i].size(0) : 1;
          t.vec[j] = t.inner[j] % VEC == 0 && aligned_to(t.grad[j], sb) &&
                     aligned_to(t.param[j], sb) && aligned_to(t.upd[j], sb) &&
                     aligned_to(t.buf[j], bb) && aligned_to(t.buf_out[j], bb);
          t.start[j] = total;
          total += t.vec[j] ? numel / VEC : numel;
        }
        t.start[t.n] = total;
        if (total == 0) continue;
        sgd_multi_kernel<scalar_t, buf_t, VEC>
            <<<cuda::grid_for(total), cuda::kThreads, 0, stream>>>(
                t, cp, count_stride, lrp, lr_stride, wdp, wd_stride, k);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    if (!has_buf || buf[0].scalar_type() == grad[0].scalar_type()) {
      launch(scalar_t{});
    } else {
      launch(float{});
    }
  });
  return {upd, buf_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CUDA, m) {
  m.impl("stacked_adam_update", &stacked_adam_update_cuda);
  m.impl("stacked_sgd_update", &stacked_sgd_update_cuda);
  m.impl("stacked_adam_update_multi", &stacked_adam_update_multi_cuda);
  m.impl("stacked_sgd_update_multi", &stacked_sgd_update_multi_cuda);
}

}  // namespace torchfn
