// CUDA kernels of op 1: softmax cross-entropy with label smoothing and ignore_index (the maths
// is written out at the top of csrc/cpu/cross_entropy.cpp).
//
// One group of threads per row: a warp (8 rows per 256-thread block) for C <= 2048, else a
// 512-thread block. The forward is a single pass over the row with an online log-sum-exp
// (running max and rescaled sum per thread, merged across the group with shuffles and shared
// memory); the backward is a single elementwise pass using the saved row statistics (max and
// log-sum, see cross_entropy.h); the double backward
// reads the row twice (a dot product, then the output). Rows are read with 16-byte vector
// loads when C is a multiple of the vector width and the pointers are 16-byte aligned. Else,
// when all the row pointers of a kernel sit at the same offset from a 16-byte boundary (odd C
// such as 50257, or a misaligned contiguous view), each row is "peeled": a scalar head up to
// its first 16-byte boundary, whole 16-byte vectors (kBatch loads in flight per thread), a
// scalar tail; rows then start at every alignment. Otherwise scalar (still coalesced) loads.
// Half/bfloat16 are computed in float.
//
// Target values are not checked on the host (that would need a device-to-host sync): a row
// whose target is outside [0, C) and not ignore_index gets a NaN loss and NaN gradients. Ignored
// rows are skipped: loss 0, stats 0, zero gradients.
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "../common.h"
#include "../cross_entropy.h"
#include "elementwise.cuh"

namespace torchfn {
namespace {

using cuda::Pack;

template <typename acc_t>
__device__ __forceinline__ acc_t neg_inf() {
  return static_cast<acc_t>(-INFINITY);
}

template <typename acc_t>
__device__ __forceinline__ acc_t quiet_nan() {
  return static_cast<acc_t>(NAN);
}

// exp on the special-function unit for float: exp2f(x * log2(e)) is ex2.approx (2 ulp) after
// one rounded multiply, a few ulp in all (at most ~1e-6 relative for the |x| < 30 that matter
// in a softmax), about half the instructions of the full-accuracy expf. The forward of
// half/bfloat16 logits is bound by exp throughput, not by memory, with expf. Double keeps exp.
__device__ __forceinline__ float fast_exp(float x) {
  return exp2f(x * 1.4426950408889634f);
}
__device__ __forceinline__ double fast_exp(double x) {
  return exp(x);
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Merge two (max, sum of exp(x - max)) pairs. A pair with max -inf has sum 0.
template <typename acc_t>
__device__ __forceinline__ void merge_max_sum(acc_t& m, acc_t& s, acc_t m2, acc_t s2) {
  const acc_t mx = m > m2 ? m : m2;
  if (mx == neg_inf<acc_t>()) {
    s = s + s2;  // both empty (0) or NaN-carrying
    m = mx;
    return;
  }
  s = s * fast_exp(m - mx) + s2 * fast_exp(m2 - mx);
  m = mx;
}

template <typename acc_t>
__device__ __forceinline__ void warp_max_sum(acc_t& m, acc_t& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const acc_t s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge_max_sum(m, s, m2, s2);
  }
}

// Reductions over the threads of one row. kThreads == 32: the row is one warp (shuffles only).
// kThreads > 32: the row is the whole block; `smem` holds kThreads / 32 values and must not be
// reused by another reduction of the same kernel (each call gets its own buffer).
template <int kThreads, typename acc_t>
__device__ __forceinline__ acc_t row_sum(acc_t v, acc_t* smem) {
  v = warp_sum(v);
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v += smem[w];
  }
  return v;
}

template <int kThreads, typename acc_t>
__device__ __forceinline__ void row_max_sum(acc_t& m, acc_t& s, acc_t* smem_m, acc_t* smem_s) {
  warp_max_sum(m, s);
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      smem_m[warp] = m;
      smem_s[warp] = s;
    }
    __syncthreads();
    m = smem_m[0];
    s = smem_s[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) merge_max_sum(m, s, smem_m[w], smem_s[w]);
  }
}

// Fold kVec values into a thread's running (max, sum of exp(x - max), sum of x).
template <typename acc_t, int kVec>
__device__ __forceinline__ void online_update(const acc_t (&v)[kVec], acc_t& m, acc_t& s,
                                              acc_t& sum_x) {
  acc_t cm = v[0];
#pragma unroll
  for (int k = 1; k < kVec; ++k) cm = v[k] > cm ? v[k] : cm;
  if (cm > m) {
    s = s * fast_exp(m - cm);  // m == -inf: s is 0 and exp(-inf) is 0
    m = cm;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    // -inf logits add nothing (and must not form -inf - -inf); NaN propagates through exp.
    if (!(v[k] == neg_inf<acc_t>())) s += fast_exp(v[k] - m);
    sum_x += v[k];
  }
}

template <typename scalar_t, typename acc_t, int kVec>
__device__ __forceinline__ void load_vec(const scalar_t* p, acc_t (&v)[kVec]) {
  if constexpr (kVec == 1) {
    v[0] = static_cast<acc_t>(p[0]);
  } else {
    const Pack<scalar_t, kVec> pk = *reinterpret_cast<const Pack<scalar_t, kVec>*>(p);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = static_cast<acc_t>(pk.v[k]);
  }
}

template <typename scalar_t, typename acc_t, int kVec>
__device__ __forceinline__ void store_vec(scalar_t* p, const acc_t (&v)[kVec]) {
  if constexpr (kVec == 1) {
    p[0] = static_cast<scalar_t>(v[0]);
  } else {
    Pack<scalar_t, kVec> pk;
#pragma unroll
    for (int k = 0; k < kVec; ++k) pk.v[k] = static_cast<scalar_t>(v[k]);
    *reinterpret_cast<Pack<scalar_t, kVec>*>(p) = pk;
  }
}

// --- peeled rows ------------------------------------------------------------------------------
// A row of c elements at p: `head` scalar elements up to the first 16-byte boundary (fewer than
// kVec, and at most c), `vecs` whole kVec-element vectors, `tail` scalar elements (< kVec).
// p must be element-aligned (the host checks it); other rows of the same kernel may sit at other
// offsets. Every element lies in exactly one part: head + vecs * kVec + tail == c.
struct RowSplit {
  int head;
  int64_t vecs;
  int tail;
};

template <typename scalar_t, int kVec>
__host__ __device__ __forceinline__ RowSplit split_row(const scalar_t* p, int64_t c) {
  constexpr int kBytes = static_cast<int>(sizeof(scalar_t)) * kVec;  // 16
  const int mis = static_cast<int>(reinterpret_cast<std::uintptr_t>(p) % kBytes);
  int64_t head = mis == 0 ? 0 : (kBytes - mis) / static_cast<int>(sizeof(scalar_t));
  if (head > c) head = c;
  const int64_t vecs = (c - head) / kVec;
  return RowSplit{static_cast<int>(head), vecs, static_cast<int>(c - head - vecs * kVec)};
}

// Vector loads a thread keeps in flight in the body of a peeled row (16 bytes each).
constexpr int kBatch = 4;

// Fold row a (and, with kIn == 2, row b at the same offset from a 16-byte boundary) into
// `fold(xa, xb)`, called with arrays of 1 (head/tail element), kBatch * kVec (a batch of
// vectors, all loads issued first) or kVec (the last vectors) opmath values: this thread's
// share of the kThreads threads of the row. With kIn == 1, xb is zeros.
template <int kThreads, int kVec, int kIn, typename scalar_t, typename F>
__device__ __forceinline__ void fold_row_peeled(const scalar_t* a, const scalar_t* b, int64_t c,
                                                int tid, F&& fold) {
  static_assert(kIn == 1 || kIn == 2, "fold_row_peeled reads one or two rows");
  using acc_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, kVec>;
  const RowSplit sp = split_row<scalar_t, kVec>(a, c);
  auto scalar_at = [&](int64_t j) {
    acc_t xa[1] = {static_cast<acc_t>(a[j])};
    acc_t xb[1] = {acc_t(0)};
    if constexpr (kIn == 2) xb[0] = static_cast<acc_t>(b[j]);
    fold(xa, xb);
  };
  if (tid < sp.head) scalar_at(tid);
  const P* pa = reinterpret_cast<const P*>(a + sp.head);
  const P* pb = reinterpret_cast<const P*>(kIn == 2 ? b + sp.head : a + sp.head);
  int64_t k = tid;
  for (; k + static_cast<int64_t>(kBatch - 1) * kThreads < sp.vecs;
       k += static_cast<int64_t>(kBatch) * kThreads) {
    P ra[kBatch], rb[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      ra[u] = pa[k + u * kThreads];
      if constexpr (kIn == 2) rb[u] = pb[k + u * kThreads];
    }
    acc_t xa[kBatch * kVec], xb[kBatch * kVec];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        xa[u * kVec + e] = static_cast<acc_t>(ra[u].v[e]);
        xb[u * kVec + e] = kIn == 2 ? static_cast<acc_t>(rb[u].v[e]) : acc_t(0);
      }
    }
    fold(xa, xb);
  }
  for (; k < sp.vecs; k += kThreads) {
    const P ra = pa[k];
    P rb;
    if constexpr (kIn == 2) rb = pb[k];
    acc_t xa[kVec], xb[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      xa[e] = static_cast<acc_t>(ra.v[e]);
      xb[e] = kIn == 2 ? static_cast<acc_t>(rb.v[e]) : acc_t(0);
    }
    fold(xa, xb);
  }
  if (tid < sp.tail) scalar_at(sp.head + sp.vecs * kVec + tid);
}

// out[j] = f(a[j], b[j], j) for this thread's share of a row of c elements; a, b (as many as
// kIn says: 0, 1 or 2; missing ones read as 0) and out sit at the same offset from a 16-byte
// boundary. Body: kBatch vectors loaded per thread before any is computed and stored.
template <int kThreads, int kVec, int kIn, typename scalar_t, typename F>
__device__ __forceinline__ void map_row_peeled(const scalar_t* a, const scalar_t* b,
                                               scalar_t* out, int64_t c, int tid, F&& f) {
  static_assert(kIn >= 0 && kIn <= 2, "map_row_peeled reads zero, one or two rows");
  using acc_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, kVec>;
  const RowSplit sp = split_row<scalar_t, kVec>(out, c);
  auto scalar_at = [&](int64_t j) {
    const acc_t xa = kIn >= 1 ? static_cast<acc_t>(a[j]) : acc_t(0);
    const acc_t xb = kIn == 2 ? static_cast<acc_t>(b[j]) : acc_t(0);
    out[j] = static_cast<scalar_t>(f(xa, xb, j));
  };
  if (tid < sp.head) scalar_at(tid);
  P* po = reinterpret_cast<P*>(out + sp.head);
  const P* pa = reinterpret_cast<const P*>(kIn >= 1 ? a + sp.head : out + sp.head);
  const P* pb = reinterpret_cast<const P*>(kIn == 2 ? b + sp.head : out + sp.head);
  auto store = [&](int64_t kv, const P& ra, const P& rb) {
    const int64_t j0 = sp.head + kv * kVec;
    P o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const acc_t xa = kIn >= 1 ? static_cast<acc_t>(ra.v[e]) : acc_t(0);
      const acc_t xb = kIn == 2 ? static_cast<acc_t>(rb.v[e]) : acc_t(0);
      o.v[e] = static_cast<scalar_t>(f(xa, xb, j0 + e));
    }
    po[kv] = o;
  };
  int64_t k = tid;
  for (; k + static_cast<int64_t>(kBatch - 1) * kThreads < sp.vecs;
       k += static_cast<int64_t>(kBatch) * kThreads) {
    P ra[kBatch], rb[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if constexpr (kIn >= 1) ra[u] = pa[k + u * kThreads];
      if constexpr (kIn == 2) rb[u] = pb[k + u * kThreads];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) store(k + u * kThreads, ra[u], rb[u]);
  }
  for (; k < sp.vecs; k += kThreads) {
    P ra, rb;
    if constexpr (kIn >= 1) ra = pa[k];
    if constexpr (kIn == 2) rb = pb[k];
    store(k, ra, rb);
  }
  if (tid < sp.tail) scalar_at(sp.head + sp.vecs * kVec + tid);
}

struct RowParams {
  int64_t n;
  int64_t c;
  int64_t ignore_index;
  double eps;
};

// kThreads threads per row, kRows rows per block (kThreads * kRows threads), kVec elements
// per load; kPeel: rows are peeled (fold_row_peeled / map_row_peeled), else every row is read
// from j = tid * kVec in steps of kThreads * kVec (kVec == 1, or C a multiple of kVec and the
// pointers aligned). Branches below depend only on the row, so a row's threads stay converged;
// with kRows > 1 (kThreads == 32) no __syncthreads is used, so whole warps may return early.
template <typename scalar_t, int kThreads, int kRows, int kVec, bool kPeel>
__global__ void __launch_bounds__(kThreads* kRows)
    xent_forward_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ target,
                        at::opmath_type<scalar_t>* __restrict__ loss,
                        at::opmath_type<scalar_t>* __restrict__ stats, RowParams prm) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t smem[3][kThreads > 32 ? kThreads / 32 : 1];
  const int tid = threadIdx.x % kThreads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  if (row >= prm.n) return;
  const int64_t c = prm.c;
  const int64_t t = target[row];
  if (t == prm.ignore_index) {
    if (tid == 0) {
      loss[row] = acc_t(0);
      stats[2 * row] = acc_t(0);
      stats[2 * row + 1] = acc_t(0);
    }
    return;
  }
  const scalar_t* xr = x + row * c;
  acc_t m = neg_inf<acc_t>(), s = acc_t(0), sum_x = acc_t(0);
  if constexpr (kPeel) {
    fold_row_peeled<kThreads, kVec, 1>(xr, xr, c, tid, [&](const auto& v, const auto&) {
      online_update(v, m, s, sum_x);
    });
  } else {
    for (int64_t j = static_cast<int64_t>(tid) * kVec; j < c; j += kThreads * kVec) {
      acc_t v[kVec];
      load_vec<scalar_t, acc_t, kVec>(xr + j, v);
      online_update<acc_t, kVec>(v, m, s, sum_x);
    }
  }
  row_max_sum<kThreads>(m, s, smem[0], smem[1]);
  const acc_t eps = static_cast<acc_t>(prm.eps);
  if (eps != acc_t(0)) sum_x = row_sum<kThreads>(sum_x, smem[2]);
  if (tid == 0) {
    const acc_t log_sum = log(s);
    stats[2 * row] = m;
    stats[2 * row + 1] = log_sum;
    if (t < 0 || t >= c) {
      loss[row] = quiet_nan<acc_t>();
    } else {
      // (1 - e)(max - x_t) + e (max - mean x) + log_sum == lse - (1 - e) x_t - e mean x, with
      // the large terms cancelled first (exact for logits of large magnitude).
      acc_t out = (acc_t(1) - eps) * (m - static_cast<acc_t>(xr[t])) + log_sum;
      if (eps != acc_t(0)) out += eps * (m - sum_x / static_cast<acc_t>(c));
      loss[row] = out;
    }
  }
}

template <typename scalar_t, int kThreads, int kRows, int kVec, bool kPeel>
__global__ void __launch_bounds__(kThreads* kRows)
    xent_backward_kernel(const at::opmath_type<scalar_t>* __restrict__ grad_loss,
                         const scalar_t* __restrict__ x, const int64_t* __restrict__ target,
                         const at::opmath_type<scalar_t>* __restrict__ stats,
                         scalar_t* __restrict__ dx, RowParams prm) {
  using acc_t = at::opmath_type<scalar_t>;
  const int tid = threadIdx.x % kThreads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  if (row >= prm.n) return;
  const int64_t c = prm.c;
  const int64_t t = target[row];
  scalar_t* out = dx + row * c;
  const scalar_t* xr = x + row * c;
  const bool ignored = t == prm.ignore_index;
  const bool bad = !ignored && (t < 0 || t >= c);
  const acc_t eps = static_cast<acc_t>(prm.eps);
  const acc_t g = ignored ? acc_t(0) : grad_loss[row];
  const acc_t mx = ignored ? acc_t(0) : stats[2 * row];
  const acc_t log_sum = ignored ? acc_t(0) : stats[2 * row + 1];
  const acc_t g_eps_c = g * eps / static_cast<acc_t>(c);
  const acc_t g_hit = g * (acc_t(1) - eps);
  if constexpr (kPeel) {
    if (ignored) {
      map_row_peeled<kThreads, kVec, 0>(xr, xr, out, c, tid,
                                        [](acc_t, acc_t, int64_t) { return acc_t(0); });
    } else {
      map_row_peeled<kThreads, kVec, 1>(xr, xr, out, c, tid, [&](acc_t xv, acc_t, int64_t j) {
        acc_t o = g * fast_exp((xv - mx) - log_sum) - g_eps_c;
        if (j == t) o -= g_hit;
        return bad ? quiet_nan<acc_t>() : o;
      });
    }
  } else {
    for (int64_t j = static_cast<int64_t>(tid) * kVec; j < c; j += kThreads * kVec) {
      acc_t v[kVec];
      if (ignored) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = acc_t(0);
      } else {
        load_vec<scalar_t, acc_t, kVec>(xr + j, v);
        const int64_t hit_k = t - j;  // the target's slot in this chunk, if in [0, kVec)
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          acc_t o = g * fast_exp((v[k] - mx) - log_sum) - g_eps_c;
          if (hit_k == k) o -= g_hit;
          v[k] = bad ? quiet_nan<acc_t>() : o;
        }
      }
      store_vec<scalar_t, acc_t, kVec>(out + j, v);
    }
  }
}

template <typename scalar_t, int kThreads, int kRows, int kVec, bool kPeel>
__global__ void __launch_bounds__(kThreads* kRows)
    xent_double_backward_kernel(const scalar_t* __restrict__ gg,
                                const at::opmath_type<scalar_t>* __restrict__ grad_loss,
                                const scalar_t* __restrict__ x,
                                const int64_t* __restrict__ target,
                                const at::opmath_type<scalar_t>* __restrict__ stats,
                                at::opmath_type<scalar_t>* __restrict__ d_grad_loss,
                                scalar_t* __restrict__ d_x, RowParams prm) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t smem[2][kThreads > 32 ? kThreads / 32 : 1];
  const int tid = threadIdx.x % kThreads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  if (row >= prm.n) return;
  const int64_t c = prm.c;
  const int64_t t = target[row];
  scalar_t* out = d_x + row * c;
  const int64_t first = static_cast<int64_t>(tid) * kVec;
  constexpr int64_t kStep = static_cast<int64_t>(kThreads) * kVec;
  if (t == prm.ignore_index) {
    if (tid == 0) d_grad_loss[row] = acc_t(0);
    if constexpr (kPeel) {
      map_row_peeled<kThreads, kVec, 0>(out, out, out, c, tid,
                                        [](acc_t, acc_t, int64_t) { return acc_t(0); });
    } else {
      acc_t z[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) z[k] = acc_t(0);
      for (int64_t j = first; j < c; j += kStep) store_vec<scalar_t, acc_t, kVec>(out + j, z);
    }
    return;
  }
  const bool bad = t < 0 || t >= c;
  const scalar_t* xr = x + row * c;
  const scalar_t* vr = gg + row * c;
  const acc_t mx = stats[2 * row], log_sum = stats[2 * row + 1];
  const acc_t eps = static_cast<acc_t>(prm.eps);
  acc_t dot = acc_t(0), sum_v = acc_t(0);
  if constexpr (kPeel) {
    fold_row_peeled<kThreads, kVec, 2>(xr, vr, c, tid, [&](const auto& xv, const auto& vv) {
      constexpr int kN = sizeof(xv) / sizeof(xv[0]);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        dot += fast_exp((xv[k] - mx) - log_sum) * vv[k];
        sum_v += vv[k];
      }
    });
  } else {
    for (int64_t j = first; j < c; j += kStep) {
      acc_t xv[kVec], vv[kVec];
      load_vec<scalar_t, acc_t, kVec>(xr + j, xv);
      load_vec<scalar_t, acc_t, kVec>(vr + j, vv);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        dot += fast_exp((xv[k] - mx) - log_sum) * vv[k];
        sum_v += vv[k];
      }
    }
  }
  dot = row_sum<kThreads>(dot, smem[0]);
  if (eps != acc_t(0)) sum_v = row_sum<kThreads>(sum_v, smem[1]);
  if (tid == 0) {
    if (bad) {
      d_grad_loss[row] = quiet_nan<acc_t>();
    } else {
      acc_t dg = dot - (acc_t(1) - eps) * static_cast<acc_t>(vr[t]);
      if (eps != acc_t(0)) dg -= eps / static_cast<acc_t>(c) * sum_v;
      d_grad_loss[row] = dg;
    }
  }
  const acc_t g = grad_loss[row];
  if constexpr (kPeel) {
    map_row_peeled<kThreads, kVec, 2>(xr, vr, out, c, tid, [&](acc_t xv, acc_t vv, int64_t) {
      const acc_t o = g * fast_exp((xv - mx) - log_sum) * (vv - dot);
      return bad ? quiet_nan<acc_t>() : o;
    });
  } else {
    for (int64_t j = first; j < c; j += kStep) {
      acc_t xv[kVec], vv[kVec];
      load_vec<scalar_t, acc_t, kVec>(xr + j, xv);
      load_vec<scalar_t, acc_t, kVec>(vr + j, vv);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t o = g * fast_exp((xv[k] - mx) - log_sum) * (vv[k] - dot);
        xv[k] = bad ? quiet_nan<acc_t>() : o;
      }
      store_vec<scalar_t, acc_t, kVec>(out + j, xv);
    }
  }
}

// How a kernel reads its rows (see the comment at the top).
enum class RowLoad { kScalar, kVector, kPeeled };

// kVector: every row pointer is 16-byte aligned (all pointers aligned, C a multiple of the
// vector width); kPeeled: the pointers are element-aligned and sit at one offset from a 16-byte
// boundary, so that every row of each of them splits alike; else kScalar.
template <typename scalar_t>
RowLoad row_load(int64_t c, std::initializer_list<const void*> ptrs) {
  constexpr int kV = cuda::VecWidth<scalar_t>::value;
  bool aligned = true, same = true, elem = true;
  const std::uintptr_t phase = reinterpret_cast<std::uintptr_t>(*ptrs.begin()) % 16;
  for (const void* p : ptrs) {
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
    aligned = aligned && a % 16 == 0;
    same = same && a % 16 == phase;
    elem = elem && a % sizeof(scalar_t) == 0;
  }
  if (aligned && c % kV == 0) return RowLoad::kVector;
  if (kV > 1 && same && elem) return RowLoad::kPeeled;
  return RowLoad::kScalar;
}

// Pick (threads per row, rows per block, vector width, peeled) and call
// launch(std::integral_constant<int, kThreads>, ..<kRows>, ..<kVec>,
//        std::integral_constant<bool, kPeel>, blocks, threads).
template <typename scalar_t, typename Launch>
void launch_rows(int64_t n, int64_t c, RowLoad load, Launch&& launch) {
  if (n == 0) return;
  constexpr int kV = cuda::VecWidth<scalar_t>::value;
  using I32 = std::integral_constant<int, 32>;
  using I512 = std::integral_constant<int, 512>;
  using R8 = std::integral_constant<int, 8>;
  using R1 = std::integral_constant<int, 1>;
  using V = std::integral_constant<int, kV>;
  using V1 = std::integral_constant<int, 1>;
  using Peel = std::true_type;
  using NoPeel = std::false_type;
  auto by_load = [&](auto threads_c, auto rows_c, int64_t blocks, int threads) {
    if (load == RowLoad::kVector) {
      launch(threads_c, rows_c, V{}, NoPeel{}, blocks, threads);
    } else if (load == RowLoad::kPeeled) {
      launch(threads_c, rows_c, V{}, Peel{}, blocks, threads);
    } else {
      launch(threads_c, rows_c, V1{}, NoPeel{}, blocks, threads);
    }
  };
  if (c <= 2048) {
    by_load(I32{}, R8{}, (n + 7) / 8, 256);
  } else {
    by_load(I512{}, R1{}, n, 512);
  }
}

at::Tensor empty_rows(const at::Tensor& logits, int64_t width = 0) {
  const auto opts = logits.options().dtype(at::toOpMathType(logits.scalar_type()));
  if (width == 0) return at::empty({logits.size(0)}, opts);
  return at::empty({logits.size(0), width}, opts);
}

RowParams row_params(const at::Tensor& x, double label_smoothing, int64_t ignore_index) {
  return RowParams{x.size(0), x.size(1), ignore_index, label_smoothing};
}

std::tuple<at::Tensor, at::Tensor> xent_forward_cuda(const at::Tensor& logits_,
                                                     const at::Tensor& target_,
                                                     double label_smoothing,
                                                     int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy";
  xent::check_logits(op, logits_, c10::DeviceType::CUDA);
  xent::check_target(op, target_, logits_);
  xent::check_smoothing(op, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits_.device());
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  at::Tensor loss = empty_rows(x);
  at::Tensor stats = empty_rows(x, 2);
  const RowParams prm = row_params(x, label_smoothing, ignore_index);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    acc_t* lossp = loss.mutable_data_ptr<acc_t>();
    acc_t* statp = stats.mutable_data_ptr<acc_t>();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    launch_rows<scalar_t>(prm.n, prm.c, row_load<scalar_t>(prm.c, {xp}),
                          [&](auto threads_c, auto rows_c, auto vec_c, auto peel_c,
                              int64_t blocks, int threads) {
                            constexpr int kT = decltype(threads_c)::value;
                            constexpr int kR = decltype(rows_c)::value;
                            constexpr int kV = decltype(vec_c)::value;
                            constexpr bool kP = decltype(peel_c)::value;
                            xent_forward_kernel<scalar_t, kT, kR, kV, kP>
                                <<<blocks, threads, 0, stream>>>(xp, tp, lossp, statp, prm);
                            C10_CUDA_KERNEL_LAUNCH_CHECK();
                          });
  });
  return {loss, stats};
}

at::Tensor xent_backward_cuda(const at::Tensor& grad_loss_, const at::Tensor& logits_,
                              const at::Tensor& target_, const at::Tensor& stats_,
                              double label_smoothing, int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy_backward";
  xent::check_logits(op, logits_, c10::DeviceType::CUDA);
  xent::check_target(op, target_, logits_);
  xent::check_row_vector(op, "grad_loss", grad_loss_, logits_);
  xent::check_stats(op, stats_, logits_);
  xent::check_smoothing(op, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits_.device());
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  const at::Tensor g = grad_loss_.contiguous();
  const at::Tensor stats = stats_.contiguous();
  at::Tensor dx = empty_contiguous_like(x);
  const RowParams prm = row_params(x, label_smoothing, ignore_index);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const acc_t* gp = g.const_data_ptr<acc_t>();
    const acc_t* statp = stats.const_data_ptr<acc_t>();
    scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    launch_rows<scalar_t>(prm.n, prm.c, row_load<scalar_t>(prm.c, {xp, dxp}),
                          [&](auto threads_c, auto rows_c, auto vec_c, auto peel_c,
                              int64_t blocks, int threads) {
                            constexpr int kT = decltype(threads_c)::value;
                            constexpr int kR = decltype(rows_c)::value;
                            constexpr int kV = decltype(vec_c)::value;
                            constexpr bool kP = decltype(peel_c)::value;
                            xent_backward_kernel<scalar_t, kT, kR, kV, kP>
                                <<<blocks, threads, 0, stream>>>(gp, xp, tp, statp, dxp, prm);
                            C10_CUDA_KERNEL_LAUNCH_CHECK();
                          });
  });
  return dx;
}

std::tuple<at::Tensor, at::Tensor> xent_double_backward_cuda(
    const at::Tensor& gg_, const at::Tensor& grad_loss_, const at::Tensor& logits_,
    const at::Tensor& target_, const at::Tensor& stats_, double label_smoothing,
    int64_t ignore_index) {
  constexpr const char* op = "softmax_cross_entropy_double_backward";
  xent::check_logits(op, logits_, c10::DeviceType::CUDA);
  xent::check_target(op, target_, logits_);
  xent::check_row_vector(op, "grad_loss", grad_loss_, logits_);
  xent::check_stats(op, stats_, logits_);
  check_float_input(op, "grad_grad_logits", gg_, c10::DeviceType::CUDA);
  check_same_as(op, "grad_grad_logits", gg_, "logits", logits_);
  xent::check_smoothing(op, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits_.device());
  const at::Tensor x = logits_.contiguous();
  const at::Tensor target = target_.contiguous();
  const at::Tensor g = grad_loss_.contiguous();
  const at::Tensor stats = stats_.contiguous();
  const at::Tensor gg = gg_.contiguous();
  at::Tensor d_grad_loss = empty_rows(x);
  at::Tensor d_x = empty_contiguous_like(x);
  const RowParams prm = row_params(x, label_smoothing, ignore_index);
  TORCHFN_DISPATCH_FLOATS(x.scalar_type(), "torchfn::softmax_cross_entropy_double_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* ggp = gg.const_data_ptr<scalar_t>();
    const int64_t* tp = target.const_data_ptr<int64_t>();
    const acc_t* gp = g.const_data_ptr<acc_t>();
    const acc_t* statp = stats.const_data_ptr<acc_t>();
    acc_t* dgp = d_grad_loss.mutable_data_ptr<acc_t>();
    scalar_t* dxp = d_x.mutable_data_ptr<scalar_t>();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    launch_rows<scalar_t>(prm.n, prm.c, row_load<scalar_t>(prm.c, {xp, ggp, dxp}),
                          [&](auto threads_c, auto rows_c, auto vec_c, auto peel_c,
                              int64_t blocks, int threads) {
                            constexpr int kT = decltype(threads_c)::value;
                            constexpr int kR = decltype(rows_c)::value;
                            constexpr int kV = decltype(vec_c)::value;
                            constexpr bool kP = decltype(peel_c)::value;
                            xent_double_backward_kernel<scalar_t, kT, kR, kV, kP>
                                <<<blocks, threads, 0, stream>>>(ggp, gp, xp, tp, statp, dgp,
                                                                 dxp, prm);
                            C10_CUDA_KERNEL_LAUNCH_CHECK();
                          });
  });
  return {d_grad_loss, d_x};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, CUDA, m) {
  m.impl("softmax_cross_entropy", &xent_forward_cuda);
  m.impl("softmax_cross_entropy_backward", &xent_backward_cuda);
  m.impl("softmax_cross_entropy_double_backward", &xent_double_backward_cuda);
}

}  // namespace torchfn
