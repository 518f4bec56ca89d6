// Vectorised, bandwidth-bound elementwise launchers for torchfn's CUDA kernels.
//
// Each thread moves 16 bytes per input per iteration (float4 / double2 / 8 halves) in a
// grid-stride loop; a scalar loop handles the tail and inputs whose pointers are not 16-byte
// aligned (views with an odd storage offset). Functors compute in at::opmath_type (float for
// half/bfloat16) and take/return opmath values.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace torchfn {
namespace cuda {

constexpr int kThreads = 256;
// Each block handles tiles of kUnroll * blockDim.x packs (grid-stride over tiles); a thread
// issues all kUnroll loads before computing, to keep enough bytes in flight per SM.
constexpr int kUnroll = 4;

template <typename scalar_t>
struct VecWidth {
  static constexpr int value = 16 / sizeof(scalar_t);
};

template <typename scalar_t, int N>
struct alignas(sizeof(scalar_t) * N) Pack {
  scalar_t v[N];
};

inline bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) % 16) == 0;
}

// Multiprocessor count of the current device (cached per device index).
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cache[dev] > 0) return cache[dev];
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cache[dev] = sms;
  return sms;
}

// Blocks for `packs` packs of work: one tile (kThreads * kUnroll packs) per block, capped at
// 16 blocks per SM (the loop strides over the rest).
inline int64_t grid_for(int64_t packs) {
  const int sms = sm_count();
  const int64_t max_blocks = static_cast<int64_t>(sms) * 16;
  const int64_t tile = static_cast<int64_t>(kThreads) * kUnroll;
  int64_t blocks = (packs + tile - 1) / tile;
  if (blocks > max_blocks) blocks = max_blocks;
  return blocks < 1 ? 1 : blocks;
}

template <typename scalar_t, int N, typename F>
__global__ void unary_vec_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                 int64_t n, F f) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, N>;
  const int64_t n_vec = n / N;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kUnroll;
  const P* xv = reinterpret_cast<const P*>(x);
  P* yv = reinterpret_cast<P*>(y);
  for (int64_t base = blockIdx.x * tile; base < n_vec; base += gridDim.x * tile) {
    P a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      if (i < n_vec) a[u] = xv[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      if (i < n_vec) {
        P out;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out.v[k] = static_cast<scalar_t>(f(static_cast<opmath_t>(a[u].v[k])));
        }
        yv[i] = out;
      }
    }
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = n_vec * N + tid; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = static_cast<scalar_t>(f(static_cast<opmath_t>(x[i])));
  }
}

template <typename scalar_t, int N, typename F>
__global__ void binary_vec_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                  scalar_t* __restrict__ y, int64_t n, F f) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, N>;
  const int64_t n_vec = n / N;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kUnroll;
  const P* av = reinterpret_cast<const P*>(a);
  const P* bv = reinterpret_cast<const P*>(b);
  P* yv = reinterpret_cast<P*>(y);
  for (int64_t base = blockIdx.x * tile; base < n_vec; base += gridDim.x * tile) {
    P pa[kUnroll];
    P pb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      if (i < n_vec) {
        pa[u] = av[i];
        pb[u] = bv[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      if (i < n_vec) {
        P out;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out.v[k] = static_cast<scalar_t>(
              f(static_cast<opmath_t>(pa[u].v[k]), static_cast<opmath_t>(pb[u].v[k])));
        }
        yv[i] = out;
      }
    }
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = n_vec * N + tid; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = static_cast<scalar_t>(f(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i])));
  }
}

// y[i] = f(x[i]) over n contiguous elements, on the current stream.
template <typename scalar_t, typename F>
void launch_unary(const scalar_t* x, scalar_t* y, int64_t n, F f) {
  if (n == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (aligned16(x) && aligned16(y)) {
    constexpr int N = VecWidth<scalar_t>::value;
    unary_vec_kernel<scalar_t, N, F>
        <<<grid_for((n + N - 1) / N), kThreads, 0, stream>>>(x, y, n, f);
  } else {
    unary_vec_kernel<scalar_t, 1, F><<<grid_for(n), kThreads, 0, stream>>>(x, y, n, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y[i] = f(a[i], b[i]) over n contiguous elements, on the current stream.
template <typename scalar_t, typename F>
void launch_binary(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n, F f) {
  if (n == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (aligned16(a) && aligned16(b) && aligned16(y)) {
    constexpr int N = VecWidth<scalar_t>::value;
    binary_vec_kernel<scalar_t, N, F>
        <<<grid_for((n + N - 1) / N), kThreads, 0, stream>>>(a, b, y, n, f);
  } else {
    binary_vec_kernel<scalar_t, 1, F><<<grid_for(n), kThreads, 0, stream>>>(a, b, y, n, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace torchfn
