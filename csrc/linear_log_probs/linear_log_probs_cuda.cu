// CUDA row passes of the chunked log-probabilities: one block per row of a chunk of logits in fp32, bf16 or fp16
// (the matmuls stay cuBLAS in the caller). Forward: one sweep of per-thread online max / sum-exp / sum of
// exp * s, merged across the block. Backward: one sweep writing the gradient in place. All math is fp32: 16-bit
// logits are widened as they are read. Raw pointers and a stream only: compiles with plain nvcc.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "linear_log_probs_cuda.h"
#include "shardkit/cuda_utils.cuh"

namespace shardkit {
namespace {

constexpr int kThreads = 512;

struct Stats {
  float m;  // running max of s
  float d;  // sum of exp(s - m)
  float w;  // sum of exp(s - m) * (s - m): centred on the max, so no cancellation at |s| ~ 10
};

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  const float m = fmaxf(a.m, b.m);
  const float fa = a.m == -INFINITY ? 0.f : expf(a.m - m);
  const float fb = b.m == -INFINITY ? 0.f : expf(b.m - m);
  // exp(s - M) * (s - M) = exp(s - m) * f * ((s - m) + (m - M)) with f = exp(m - M)
  const float wa = a.m == -INFINITY ? 0.f : fa * (a.w + (a.m - m) * a.d);
  const float wb = b.m == -INFINITY ? 0.f : fb * (b.w + (b.m - m) * b.d);
  return Stats{m, a.d * fa + b.d * fb, wa + wb};
}

__device__ __forceinline__ float scaled(float z, float cap, float inv_temp) {
  return (cap > 0.f ? cap * tanhf(z / cap) : z) * inv_temp;
}

template <typename T>
__global__ void llp_fwd_kernel(const T* __restrict__ logits, int64_t vocab, int64_t ld,
                               const int64_t* __restrict__ labels, float cap, float inv_temp,
                               float* __restrict__ lse, float* __restrict__ target, float* __restrict__ m_out) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * ld;
  Stats st{-INFINITY, 0.f, 0.f};
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float s = scaled(cuda::to_f32(z[j]), cap, inv_temp);
    st = merge(st, Stats{s, 1.f, 0.f});
  }
  for (int off = 16; off > 0; off >>= 1) {
    const Stats o{__shfl_xor_sync(0xffffffffu, st.m, off), __shfl_xor_sync(0xffffffffu, st.d, off),
                  __shfl_xor_sync(0xffffffffu, st.w, off)};
    st = merge(st, o);
  }
  __shared__ Stats warp_stats[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (threadIdx.x != 0) return;
  Stats all = warp_stats[0];
  for (int k = 1; k < static_cast<int>(blockDim.x / 32); ++k) all = merge(all, warp_stats[k]);
  lse[row] = all.m + logf(all.d);
  const int64_t label = labels[row];
  target[row] = (label >= 0 && label < vocab) ? scaled(cuda::to_f32(z[label]), cap, inv_temp) : 0.f;
  if (m_out != nullptr) m_out[row] = all.m + all.w / all.d;
}

template <typename T>
__global__ void llp_bwd_kernel(T* __restrict__ logits, int64_t vocab, int64_t ld, const int64_t* __restrict__ labels,
                               const float* __restrict__ grad_lp, const float* __restrict__ grad_ent,
                               const float* __restrict__ lse, const float* __restrict__ m, float cap,
                               float inv_temp) {
  const int64_t row = blockIdx.x;
  T* z = logits + row * ld;
  const float gl = grad_lp[row];
  const float ge = grad_ent != nullptr ? grad_ent[row] : 0.f;
  const float l = lse[row];
  const float c = grad_ent != nullptr ? m[row] - l : 0.f;
  const int64_t label = labels[row];
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float g = 0.f;
    if (gl != 0.f || ge != 0.f) {
      const float y = cap > 0.f ? cap * tanhf(cuda::to_f32(z[j]) / cap) : cuda::to_f32(z[j]);
      const float d = y * inv_temp - l;  // s - m as (s - lse) - (m - lse): no cancellation at |s| ~ 10
      g = expf(d) * (ge * (c - d) - gl);
      if (j == label) g += gl;
      g *= inv_temp;
      if (cap > 0.f) g *= 1.f - (y / cap) * (y / cap);
    }
    z[j] = cuda::from_f32<T>(g);
  }
}

}  // namespace

cudaError_t llp_rows_fwd_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                              const int64_t* labels, float softcap, float inv_temp, float* lse, float* target,
                              float* m, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL) return cudaErrorInvalidValue;  // one block per row on grid.x
  return cuda::dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    llp_fwd_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab, ld, labels, softcap, inv_temp, lse, target, m);
    return cudaGetLastError();
  });
}

cudaError_t llp_rows_bwd_cuda(void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                              const int64_t* labels, const float* grad_lp, const float* grad_ent, const float* lse,
                              const float* m, float softcap, float inv_temp, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL) return cudaErrorInvalidValue;
  return cuda::dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    llp_bwd_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<T*>(logits), vocab, ld, labels, grad_lp, grad_ent, lse, m, softcap, inv_temp);
    return cudaGetLastError();
  });
}

}  // namespace shardkit
