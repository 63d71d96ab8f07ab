// CUDA row pass of fused linear cross-entropy: one block per row of a chunk of logits in fp32, bf16 or fp16 (the
// matmuls stay cuBLAS in the caller). Sweep 1: per-thread online max / sum-exp and sum of y, merged across the
// block; sweep 2: the gradient written in place, rounded to nearest even into the logits' dtype. All math is fp32:
// 16-bit logits are widened as they are read, so the chunk loop holds no fp32 copy of a chunk. Raw pointers and a
// stream only: compiles with plain nvcc.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fused_linear_cross_entropy_cuda.h"
#include "shardkit/cuda_utils.cuh"

namespace shardkit {
namespace {

constexpr int kThreads = 512;  // 16 warps: a 128 Ki-vocab row is 256 floats per thread per sweep

struct Stats {
  float m;  // running max
  float d;  // sum of exp(y - m)
  float s;  // sum of y
};

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  const float m = fmaxf(a.m, b.m);
  const float d = (a.m == -INFINITY ? 0.f : a.d * expf(a.m - m)) + (b.m == -INFINITY ? 0.f : b.d * expf(b.m - m));
  return Stats{m, d, a.s + b.s};
}

__device__ __forceinline__ float capped(float x, float cap) { return cap > 0.f ? cap * tanhf(x / cap) : x; }

template <typename T>
__global__ void flce_rows_kernel(T* __restrict__ logits, int64_t vocab, int64_t ld,
                                 const int64_t* __restrict__ labels, const float* __restrict__ row_scale,
                                 float* __restrict__ loss, int64_t ignore_index, float eps, float cap,
                                 bool write_grad) {
  const int64_t row = blockIdx.x;
  T* y = logits + row * ld;
  const int64_t label = labels[row];
  if (label == ignore_index || label < 0 || label >= vocab) {
    // out-of-range labels are rejected by the caller; ignored rows: no loss, no gradient
    if (threadIdx.x == 0) loss[row] = label == ignore_index ? 0.f : NAN;
    if (write_grad)
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) y[j] = cuda::from_f32<T>(0.f);
    return;
  }
  Stats st{-INFINITY, 0.f, 0.f};
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = capped(cuda::to_f32(y[j]), cap);
    st = merge(st, Stats{v, 1.f, v});
  }
  for (int off = 16; off > 0; off >>= 1) {
    Stats o{__shfl_xor_sync(0xffffffffu, st.m, off), __shfl_xor_sync(0xffffffffu, st.d, off),
            __shfl_xor_sync(0xffffffffu, st.s, off)};
    st = merge(st, o);
  }
  __shared__ Stats warp_stats[kThreads / 32];
  __shared__ float shared_lse;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stats all = warp_stats[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) all = merge(all, warp_stats[w]);
    const float lse = all.m + logf(all.d);
    shared_lse = lse;
    loss[row] = lse - (1.f - eps) * capped(cuda::to_f32(y[label]), cap) - eps * (all.s / static_cast<float>(vocab));
  }
  __syncthreads();
  if (!write_grad) return;
  const float lse = shared_lse;
  const float scale = row_scale ? row_scale[row] : 1.f;
  const float off = eps / static_cast<float>(vocab);
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = capped(cuda::to_f32(y[j]), cap);
    float g = expf(v - lse) - off - (j == label ? 1.f - eps : 0.f);
    if (cap > 0.f) g *= 1.f - (v / cap) * (v / cap);
    y[j] = cuda::from_f32<T>(scale * g);
  }
}

}  // namespace

cudaError_t flce_rows_cuda(void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                           const int64_t* labels, const float* row_scale, float* loss, int64_t ignore_index,
                           float label_smoothing, float softcap, bool write_grad, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL) return cudaErrorInvalidValue;  // one block per row on grid.x
  return cuda::dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    flce_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<T*>(logits), vocab, ld, labels, row_scale, loss, ignore_index, label_smoothing, softcap,
        write_grad);
    return cudaGetLastError();
  });
}

}  // namespace shardkit
