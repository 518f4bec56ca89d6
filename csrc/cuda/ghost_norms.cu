// CUDA kernels of op 3 (linear_grad_norms_sq, its backward, clipped_linear_grad_sum).
//
// 2-D inputs are bandwidth-bound and get fused kernels: a group of TPR threads (8 threads, a warp
// or the whole block, by row length) owns one (sample, split) work item, reads its segment of a_i
// and g_i once with 16-byte loads, and reduces both squared norms together in opmath (float for
// half/bfloat16). Each thread keeps several 16-byte loads in flight before using any (the
// reduction reads a_i and g_i side by side, kBatch packs of each; the rescaling walks them as
// one sequence, kScaleBatch packs), and each grid is one wave of the blocks that fit on the GPU
// at the kernel's register use (cudaOccupancyMaxActiveBlocksPerMultiprocessor), the kernels
// striding over the items. Rows are split across several groups (S > 1) only when the batch is
// too small to fill the GPU; then per-split partial sums go to a small workspace and a second
// kernel finishes. The forward also returns aux = the two squared row norms per sample, so that
// the backward is one elementwise pass:
//   da_i = 2 w_i ||g_i||^2 a_i,  dg_i = 2 w_i (||a_i||^2 + b) g_i
// (without aux, it reduces each row and rescales it from L1/L2, or uses partials if S > 1).
// 3-D inputs and the clipped sum are GEMMs: the device-generic ATen code of ghost_norms.h
// (cuBLAS through at::bmm / at::mm).
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "../common.h"
#include "../ghost_norms.h"
#include "elementwise.cuh"

namespace torchfn {
namespace {

using cuda::Pack;

enum class Mode { kForward, kPartial, kBackward };

__host__ __device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

// Packs a thread loads from each tensor before using any of them (16 bytes each with V > 1):
// with a and g read side by side, 2 * kBatch loads are in flight per thread.
constexpr int kBatch = 4;
// The same for the rescaling pass (loads, then stores), over a and g as one sequence.
constexpr int kScaleBatch = 4;

// This thread's share (of a group of TPR threads) of the sums of squares of a[a_lo, a_hi) and
// g[g_lo, g_hi), read side by side: each step loads kBatch packs of each (loads past a segment's
// end are skipped and count as zeros) before accumulating any. With V > 1, the bounds are
// multiples of V and a, g are 16-byte aligned.
template <typename scalar_t, int V, int TPR>
__device__ __forceinline__ void segment_sum_sq2(const scalar_t* a, int64_t a_lo, int64_t a_hi,
                                                const scalar_t* g, int64_t g_lo, int64_t g_hi,
                                                int lane, at::opmath_type<scalar_t>& sa,
                                                at::opmath_type<scalar_t>& sg) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const P* pa = reinterpret_cast<const P*>(a + a_lo);
  const P* pg = reinterpret_cast<const P*>(g + g_lo);
  const int64_t na = (a_hi - a_lo) / V, ng = (g_hi - g_lo) / V;
  const int64_t n = na > ng ? na : ng;
  opmath_t acc_a[kBatch], acc_g[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) acc_a[u] = acc_g[u] = opmath_t(0);
  // Each step's packs sit at constant offsets from qa, qg; ra, rg count the packs left from
  // the step's start.
  for (int64_t k = lane; k < n; k += static_cast<int64_t>(kBatch) * TPR) {
    const P* qa = pa + k;
    const P* qg = pg + k;
    const int64_t ra = na - k, rg = ng - k;
    P va[kBatch], vg[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) va[u].v[j] = vg[u].v[j] = scalar_t(0);
      if (u * TPR < ra) va[u] = qa[u * TPR];
      if (u * TPR < rg) vg[u] = qg[u * TPR];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const opmath_t x = static_cast<opmath_t>(va[u].v[j]);
        const opmath_t y = static_cast<opmath_t>(vg[u].v[j]);
        acc_a[u] += x * x;
        acc_g[u] += y * y;
      }
    }
  }
  static_assert(kBatch == 4, "the pairwise sums below assume kBatch == 4");
  sa = (acc_a[0] + acc_a[1]) + (acc_a[2] + acc_a[3]);
  sg = (acc_g[0] + acc_g[1]) + (acc_g[2] + acc_g[3]);
}

// The two factors of a rescaling pass: da = a * a_scale, dg = g * g_scale.
template <typename T>
struct ScalePair {
  T a_scale, g_scale;
};

// da[a_lo, a_hi) = a[a_lo, a_hi) * scale_a and dg[g_lo, g_hi) = g[g_lo, g_hi) * scale_g, this
// thread's share of the group. The two segments are walked as one sequence of packs (a's, then
// g's), so that each step loads kScaleBatch packs before storing any, up to the end of both
// (a and g may differ much in length). `scales()` returns a ScalePair; it is called once,
// after the first step's loads are issued, so that the loads it makes (the row's sums, its
// weight) overlap them.
template <typename scalar_t, int V, int TPR, typename Scales>
__device__ __forceinline__ void segment_scale2(const scalar_t* a, scalar_t* da, int64_t a_lo,
                                               int64_t a_hi, const scalar_t* g, scalar_t* dg,
                                               int64_t g_lo, int64_t g_hi, int lane,
                                               Scales&& scales) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, V>;
  const P* pa = reinterpret_cast<const P*>(a + a_lo);
  const P* pg = reinterpret_cast<const P*>(g + g_lo);
  P* pda = reinterpret_cast<P*>(da + a_lo);
  P* pdg = reinterpret_cast<P*>(dg + g_lo);
  const int64_t na = (a_hi - a_lo) / V;
  const int64_t n = na + (g_hi - g_lo) / V;  // packs [0, na) are a's, [na, n) g's
  int64_t k = lane;
  if (k >= n) return;
  constexpr int64_t kStep = static_cast<int64_t>(kScaleBatch) * TPR;
  P v[kScaleBatch];
  auto load = [&] {
#pragma unroll
    for (int u = 0; u < kScaleBatch; ++u) {
      const int64_t i = k + u * TPR;
      if (i < na) {
        v[u] = pa[i];
      } else if (i < n) {
        v[u] = pg[i - na];
      }
    }
  };
  load();
  const ScalePair<opmath_t> sc = scales();
  const opmath_t scale_a = sc.a_scale, scale_g = sc.g_scale;
  while (true) {
#pragma unroll
    for (int u = 0; u < kScaleBatch; ++u) {
      const int64_t i = k + u * TPR;
      if (i < n) {
        const bool in_a = i < na;
        const opmath_t scale = in_a ? scale_a : scale_g;
        P o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          o.v[j] = static_cast<scalar_t>(static_cast<opmath_t>(v[u].v[j]) * scale);
        }
        if (in_a) {
          pda[i] = o;
        } else {
          pdg[i - na] = o;
        }
      }
    }
    k += kStep;
    if (k >= n) break;
    load();
  }
}

// Sums x and y over the group; every thread of the group gets the same totals (the xor
// butterfly is order-symmetric, and every thread sums the per-warp values in one order).
// Groups of TPR < 32 threads are aligned sub-warps; all 32 lanes of a warp always take part.
template <int TPR, typename T>
__device__ __forceinline__ void group_sum2(T& x, T& y, T* smem) {
#pragma unroll
  for (int off = (TPR < 32 ? TPR : 32) / 2; off > 0; off >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, off);
    y += __shfl_xor_sync(0xffffffffu, y, off);
  }
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    const int warp = threadIdx.x / 32;
    __syncthreads();  // smem may still be read by the previous item
    if (threadIdx.x % 32 == 0) {
      smem[warp] = x;
      smem[kWarps + warp] = y;
    }
    __syncthreads();
    x = 0;
    y = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      x += smem[w];
      y += smem[kWarps + w];
    }
  }
}

struct Plan {
  int vec;       // elements per load: 16 bytes' worth, or 1 (unaligned rows)
  int tpr;       // threads per (sample, split) item: 8, 32 or 256
  int splits;    // S: splits per row
  int64_t chunk_in, chunk_out;  // split lengths (multiples of vec)
  int64_t blocks;
};

// Blocks of cuda::kThreads threads of `kernel` that fit on one multiprocessor at a time (its
// registers and static shared memory decide), at least 1.
template <typename Kernel>
int blocks_per_sm(Kernel kernel) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, cuda::kThreads, 0));
  return std::max(n, 1);
}

// Splits, split lengths and grid of plan `p` (vec and tpr set) for a kernel of which
// `per_sm` blocks are resident per multiprocessor: rows are split only when B groups cannot
// fill the GPU, and the grid is one wave of resident blocks (the kernels stride over the rest),
// so that no block waits for another to finish.
inline void size_plan(Plan& p, int per_sm, int64_t B, int64_t d_in, int64_t d_out) {
  const int64_t row_loads = (d_in + d_out + p.vec - 1) / p.vec;
  const int64_t groups_per_block = cuda::kThreads / p.tpr;
  const int64_t resident_blocks = static_cast<int64_t>(cuda::sm_count()) * per_sm;
  const int64_t resident_groups = resident_blocks * groups_per_block;
  int64_t splits = 1;
  if (B < resident_groups) {
    // B * splits <= resident_groups: one more item than there are groups would double the time.
    const int64_t want = std::max<int64_t>(1, resident_groups / std::max<int64_t>(B, 1));
    const int64_t most = std::max<int64_t>(1, row_loads / (4 * p.tpr));
    splits = std::min(want, most);
  }
  p.splits = static_cast<int>(splits);
  auto chunk = [&](int64_t d) {
    const int64_t c = (d + splits - 1) / splits;
    return (c + p.vec - 1) / p.vec * p.vec;
  };
  p.chunk_in = chunk(d_in);
  p.chunk_out = chunk(d_out);
  const int64_t items = B * splits;
  p.blocks = std::min<int64_t>((items + groups_per_block - 1) / groups_per_block, resident_blocks);
  p.blocks = std::max<int64_t>(p.blocks, 1);
}

// Vector width and group size for rows of d_in + d_out elements: a group gets >= 4 loads per
// thread where possible (8 threads for short rows, a warp, or the whole block). Splits and grid
// are sized for full occupancy here; fit_plan resizes them for the kernel actually launched.
template <typename scalar_t>
Plan make_plan(const scalar_t* a, const scalar_t* g, int64_t B, int64_t d_in, int64_t d_out) {
  constexpr int kVec = cuda::VecWidth<scalar_t>::value;
  Plan p{};
  const bool vec_ok = cuda::aligned16(a) && cuda::aligned16(g) && d_in % kVec == 0 &&
                      d_out % kVec == 0;
  p.vec = vec_ok ? kVec : 1;
  const int64_t row_loads = (d_in + d_out + p.vec - 1) / p.vec;
  p.tpr = row_loads <= 8 * 8 ? 8 : (row_loads <= 32 * 16 ? 32 : 256);
  size_plan(p, 2048 / cuda::kThreads, B, d_in, d_out);
  return p;
}

// Re-size p's splits and grid for the occupancy of `kernel` (the plan's vec and tpr are kept).
template <typename Kernel>
void fit_plan(Plan& p, Kernel kernel, int64_t B, int64_t d_in, int64_t d_out) {
  size_plan(p, blocks_per_sm(kernel), B, d_in, d_out);
}

// One (sample, split) work item per group of TPR threads, grid-stride over items. Every group
// runs every iteration (an item past the end reads nothing and writes nothing), so that the
// warp shuffles and block barriers of group_sum2 see all their threads.
//   kForward (S == 1): out[row] = (||a||^2 + bias) ||g||^2, aux[row] = {||a||^2, ||g||^2}.
//   kPartial: partial[item] = this split's {sum a^2, sum g^2}.
//   kBackward (S == 1, no aux): reduce the row, then rescale it into da, dg.
template <typename scalar_t, int V, int TPR, Mode M>
__global__ void __launch_bounds__(256)
    row_norms_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ g,
                     const scalar_t* __restrict__ w, scalar_t* __restrict__ out,
                     at::opmath_type<scalar_t>* __restrict__ aux, scalar_t* __restrict__ da,
                     scalar_t* __restrict__ dg, at::opmath_type<scalar_t>* __restrict__ partial,
                     int64_t B, int64_t d_in, int64_t d_out, int S, int64_t chunk_in,
                     int64_t chunk_out, bool bias) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int kGroups = 256 / TPR;
  __shared__ opmath_t smem[2 * (TPR > 32 ? TPR / 32 : 1)];
  const int group = threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;
  const int64_t n_items = B * S;
  const opmath_t beta = bias ? opmath_t(1) : opmath_t(0);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGroups; base < n_items;
       base += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t item = base + group;
    const bool valid = item < n_items;
    const int64_t row = valid ? item / S : 0;
    const int64_t s = valid ? item % S : 0;
    const int64_t in_lo = valid ? min64(s * chunk_in, d_in) : 0;
    const int64_t in_hi = valid ? min64(in_lo + chunk_in, d_in) : 0;
    const int64_t out_lo = valid ? min64(s * chunk_out, d_out) : 0;
    const int64_t out_hi = valid ? min64(out_lo + chunk_out, d_out) : 0;
    const scalar_t* ar = a + row * d_in;
    const scalar_t* gr = g + row * d_out;
    opmath_t sa, sg;
    segment_sum_sq2<scalar_t, V, TPR>(ar, in_lo, in_hi, gr, out_lo, out_hi, lane, sa, sg);
    group_sum2<TPR>(sa, sg, smem);
    if (!valid) continue;
    if constexpr (M == Mode::kForward) {
      if (lane == 0) {
        out[row] = static_cast<scalar_t>((sa + beta) * sg);
        aux[2 * row] = sa;
        aux[2 * row + 1] = sg;
      }
    } else if constexpr (M == Mode::kPartial) {
      if (lane == 0) {
        partial[2 * item] = sa;
        partial[2 * item + 1] = sg;
      }
    } else {
      const opmath_t two_w = opmath_t(2) * static_cast<opmath_t>(w[row]);
      segment_scale2<scalar_t, V, TPR>(
          ar, da + row * d_in, in_lo, in_hi, gr, dg + row * d_out, out_lo, out_hi, lane,
          [&] { return ScalePair<opmath_t>{two_w * sg, two_w * (sa + beta)}; });
    }
  }
}

// Forward with S > 1: out[row] = (sum_s sa + bias) * sum_s sg; aux[row] = the two sums.
template <typename scalar_t>
__global__ void finish_forward_kernel(const at::opmath_type<scalar_t>* __restrict__ partial,
                                      scalar_t* __restrict__ out,
                                      at::opmath_type<scalar_t>* __restrict__ aux, int64_t B,
                                      int S, bool bias) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= B) return;
  opmath_t sa = 0, sg = 0;
  for (int s = 0; s < S; ++s) {
    sa += partial[2 * (row * S + s)];
    sg += partial[2 * (row * S + s) + 1];
  }
  out[row] = static_cast<scalar_t>((sa + (bias ? opmath_t(1) : opmath_t(0))) * sg);
  aux[2 * row] = sa;
  aux[2 * row + 1] = sg;
}

// Backward from known row sums: sums[row] holds n_sums {sum a^2, sum g^2} pairs (1: the
// forward's aux; S: this call's partials). Each (row, split) item rescales its segments.
template <typename scalar_t, int V, int TPR>
__global__ void __launch_bounds__(256)
    scale_rows_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ g,
                      const scalar_t* __restrict__ w,
                      const at::opmath_type<scalar_t>* __restrict__ sums, int n_sums,
                      scalar_t* __restrict__ da, scalar_t* __restrict__ dg, int64_t B,
                      int64_t d_in, int64_t d_out, int S, int64_t chunk_in, int64_t chunk_out,
                      bool bias) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int kGroups = 256 / TPR;
  const int group = threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;
  const int64_t n_items = B * S;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGroups; base < n_items;
       base += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t item = base + group;
    if (item >= n_items) break;  // no warp- or block-wide operations below
    const int64_t row = item / S;
    const int64_t s = item % S;
    const int64_t in_lo = min64(s * chunk_in, d_in);
    const int64_t in_hi = min64(in_lo + chunk_in, d_in);
    const int64_t out_lo = min64(s * chunk_out, d_out);
    const int64_t out_hi = min64(out_lo + chunk_out, d_out);
    // The row's sums and weight are read after the first packs of a and g are requested.
    auto scales = [&] {
      opmath_t sa = 0, sg = 0;
      for (int j = 0; j < n_sums; ++j) {
        sa += sums[2 * (row * n_sums + j)];
        sg += sums[2 * (row * n_sums + j) + 1];
      }
      const opmath_t two_w = opmath_t(2) * static_cast<opmath_t>(w[row]);
      return ScalePair<opmath_t>{two_w * sg, two_w * (sa + (bias ? opmath_t(1) : opmath_t(0)))};
    };
    segment_scale2<scalar_t, V, TPR>(a + row * d_in, da + row * d_in, in_lo, in_hi,
                                     g + row * d_out, dg + row * d_out, out_lo, out_hi, lane,
                                     scales);
  }
}

// Calls f(integral_constant<V>, integral_constant<TPR>) for the plan's vector width and group.
template <typename scalar_t, typename F>
void with_plan(const Plan& p, F&& f) {
  constexpr int kVec = cuda::VecWidth<scalar_t>::value;
  using Vec = std::integral_constant<int, kVec>;
  using One = std::integral_constant<int, 1>;
  auto by_group = [&](auto v) {
    if (p.tpr == 8) {
      f(v, std::integral_constant<int, 8>{});
    } else if (p.tpr == 32) {
      f(v, std::integral_constant<int, 32>{});
    } else {
      f(v, std::integral_constant<int, 256>{});
    }
  };
  if (p.vec == kVec) {
    by_group(Vec{});
  } else {
    by_group(One{});
  }
}

std::tuple<at::Tensor, at::Tensor> linear_grad_norms_sq_cuda(const at::Tensor& a_,
                                                             const at::Tensor& g_, bool bias,
                                                             c10::string_view method) {
  constexpr const char* op = "linear_grad_norms_sq";
  ghost::check_pair(op, a_, g_, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a_.device());
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
  if (B == 0) return {out, aux};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCHFN_DISPATCH_FLOATS(a.scalar_type(), "torchfn::linear_grad_norms_sq", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* outp = out.mutable_data_ptr<scalar_t>();
    opmath_t* auxp = aux.mutable_data_ptr<opmath_t>();
    Plan p = make_plan(ap, gp, B, d_in, d_out);
    with_plan<scalar_t>(p, [&](auto v, auto t) {
      fit_plan(p, row_norms_kernel<scalar_t, decltype(v)::value, decltype(t)::value,
                                   Mode::kForward>, B, d_in, d_out);
    });
    if (p.splits == 1) {
      with_plan<scalar_t>(p, [&](auto v, auto t) {
        row_norms_kernel<scalar_t, decltype(v)::value, decltype(t)::value, Mode::kForward>
            <<<p.blocks, cuda::kThreads, 0, stream>>>(ap, gp, nullptr, outp, auxp, nullptr,
                                                      nullptr, nullptr, B, d_in, d_out, 1,
                                                      p.chunk_in, p.chunk_out, bias);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    at::Tensor partial = at::empty({B * p.splits * 2}, aux.options());
    opmath_t* pp = partial.mutable_data_ptr<opmath_t>();
    with_plan<scalar_t>(p, [&](auto v, auto t) {
      row_norms_kernel<scalar_t, decltype(v)::value, decltype(t)::value, Mode::kPartial>
          <<<p.blocks, cuda::kThreads, 0, stream>>>(ap, gp, nullptr, nullptr, nullptr, nullptr,
                                                    nullptr, pp, B, d_in, d_out, p.splits,
                                                    p.chunk_in, p.chunk_out, bias);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    finish_forward_kernel<scalar_t><<<(B + 255) / 256, 256, 0, stream>>>(pp, outp, auxp, B,
                                                                         p.splits, bias);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, aux};
}

std::tuple<at::Tensor, at::Tensor> linear_grad_norms_sq_backward_cuda(
    const at::Tensor& grad_, const at::Tensor& a_, const at::Tensor& g_,
    const std::optional<at::Tensor>& aux_, bool bias, c10::string_view method) {
  constexpr const char* op = "linear_grad_norms_sq_backward";
  ghost::check_pair(op, a_, g_, c10::DeviceType::CUDA);
  ghost::check_per_sample(op, "grad", grad_, a_);
  const bool gram = ghost::use_gram(op, method, a_.dim() == 3 ? a_.size(1) : 1, a_.size(-1),
                                    g_.size(-1));
  const bool has_aux = aux_.has_value() && aux_->defined();
  if (has_aux) ghost::check_aux(op, *aux_, a_, g_, gram);
  const c10::cuda::CUDAGuard guard(a_.device());
  const at::Tensor aux = has_aux ? aux_->contiguous() : at::Tensor();
  const at::Tensor a = a_.contiguous();
  const at::Tensor g = g_.contiguous();
  const at::Tensor grad = grad_.contiguous();
  if (a.dim() == 3) return ghost::norms_sq_3d_backward(grad, a, g, aux, bias, gram);
  const int64_t B = a.size(0), d_in = a.size(1), d_out = g.size(1);
  at::Tensor da = empty_contiguous_like(a);
  at::Tensor dg = empty_contiguous_like(g);
  if (B == 0) return {da, dg};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCHFN_DISPATCH_FLOATS(a.scalar_type(), "torchfn::linear_grad_norms_sq_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* wp = grad.const_data_ptr<scalar_t>();
    scalar_t* dap = da.mutable_data_ptr<scalar_t>();
    scalar_t* dgp = dg.mutable_data_ptr<scalar_t>();
    // Vector loads/stores need da/dg aligned too (fresh allocations always are).
    Plan p = make_plan(ap, gp, B, d_in, d_out);
    if (!(cuda::aligned16(dap) && cuda::aligned16(dgp))) p.vec = 1;
    with_plan<scalar_t>(p, [&](auto v, auto t) {
      constexpr int V = decltype(v)::value;
      constexpr int TPR = decltype(t)::value;
      if (has_aux) {
        fit_plan(p, scale_rows_kernel<scalar_t, V, TPR>, B, d_in, d_out);
      } else {
        fit_plan(p, row_norms_kernel<scalar_t, V, TPR, Mode::kBackward>, B, d_in, d_out);
      }
    });
    if (has_aux) {  // the forward's row sums: one pass, read a and g, write da and dg
      const opmath_t* sums = aux.const_data_ptr<opmath_t>();
      with_plan<scalar_t>(p, [&](auto v, auto t) {
        scale_rows_kernel<scalar_t, decltype(v)::value, decltype(t)::value>
            <<<p.blocks, cuda::kThreads, 0, stream>>>(ap, gp, wp, sums, 1, dap, dgp, B, d_in,
                                                      d_out, p.splits, p.chunk_in, p.chunk_out,
                                                      bias);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    if (p.splits == 1) {  // reduce each row, then rescale it (re-read from L1/L2)
      with_plan<scalar_t>(p, [&](auto v, auto t) {
        row_norms_kernel<scalar_t, decltype(v)::value, decltype(t)::value, Mode::kBackward>
            <<<p.blocks, cuda::kThreads, 0, stream>>>(ap, gp, wp, nullptr, nullptr, dap, dgp,
                                                      nullptr, B, d_in, d_out, 1, p.chunk_in,
                                                      p.chunk_out, bias);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    at::Tensor partial = at::empty({B * p.splits * 2},
                                   a.options().dtype(ghost::opmath_dtype(a.scalar_type())));
    opmath_t* pp = partial.mutable_data_ptr<opmath_t>();
    with_plan<scalar_t>(p, [&](auto v, auto t) {
      constexpr int V = decltype(v)::value;
      constexpr int TPR = decltype(t)::value;
      row_norms_kernel<scalar_t, V, TPR, Mode::kPartial>
          <<<p.blocks, cuda::kThreads, 0, stream>>>(ap, gp, nullptr, nullptr, nullptr, nullptr,
                                                    nullptr, pp, B, d_in, d_out, p.splits,
                                                    p.chunk_in, p.chunk_out, bias);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      scale_rows_kernel<scalar_t, V, TPR><<<p.blocks, cuda::kThreads, 0, stream>>>(
          ap, gp, wp, pp, p.splits, dap, dgp, B, d_in, d_out, p.splits, p.chunk_in,
          p.chunk_out, bias);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {da, dg};
}

at::Tensor clipped_linear_grad_sum_cuda(const at::Tensor& a, const at::Tensor& g,
                                        const at::Tensor& coef) {
  constexpr const char* op = "clipped_linear_grad_sum";
  ghost::check_pair(op, a, g, c10::DeviceType::CUDA);
  ghost::check_per_sample(op, "coef", coef, a);
  const c10::cuda::CUDAGuard guard(a.device());
  return ghost::clipped_sum(a.contiguous(), g.contiguous(), coef.contiguous());
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CUDA, m) {
  m.impl("linear_grad_norms_sq", &linear_grad_norms_sq_cuda);
  m.impl("linear_grad_norms_sq_backward", &linear_grad_norms_sq_backward_cuda);
  m.impl("clipped_linear_grad_sum", &clipped_linear_grad_sum_cuda);
}

}  // namespace torchfn
