// SwiGLU / GeGLU CUDA kernels + launchers (plain nvcc, no torch headers). Mirrors swiglu_cpu.h:
// y = g * sigmoid(a(g)) * u with a(g) = g (silu) or 2 sqrt(2/pi) (g + 0.044715 g^3) (gelu_tanh).
#include <type_traits>

#include "shardkit/cuda_utils.cuh"
#include "swiglu_cuda.h"

namespace shardkit {
namespace {

using cuda::from_f32;
using cuda::to_f32;

template <int K>
__device__ __forceinline__ float act_arg(float g) {
  return K == 0 ? g : 1.5957691216057308f * (g + 0.044715f * g * g * g);
}

template <int K>
__device__ __forceinline__ float act_darg(float g) {
  return K == 0 ? 1.f : 1.5957691216057308f * (1.f + 3.f * 0.044715f * g * g);
}

// Grid-stride loop; 256 threads x (SMs * 8) blocks keeps every SM busy on memory-bound elementwise work.
template <int K, typename T>
__global__ void glu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = to_f32(g[i]);
    y[i] = from_f32<T>(gv / (1.f + __expf(-act_arg<K>(gv))) * to_f32(u[i]));
  }
}

// No __restrict__: dg may alias g and du may alias u (in place). Each thread loads its element in full before
// it stores, and no other thread touches that element.
template <int K, typename T>
__global__ void glu_bwd_kernel(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = to_f32(g[i]);
    const float uv = to_f32(u[i]);
    const float d = to_f32(dy[i]);
    const float sig = 1.f / (1.f + __expf(-act_arg<K>(gv)));
    const float dgv = d * uv * (sig + gv * sig * (1.f - sig) * act_darg<K>(gv));
    const float duv = d * gv * sig;
    dg[i] = from_f32<T>(dgv);
    du[i] = from_f32<T>(duv);
  }
}

unsigned grid_for(int64_t n) {
  int device = 0, sms = 108;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t needed = (n + 255) / 256;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  return static_cast<unsigned>(needed < cap ? needed : cap);
}

}  // namespace

cudaError_t glu_fwd_cuda(GluKind kind, const void* gate, const void* up, void* y, int64_t numel, DType dtype,
                         cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  return cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto g = static_cast<const T*>(gate);
    const auto u = static_cast<const T*>(up);
    if (kind == GluKind::kSilu) {
      glu_fwd_kernel<0, T><<<grid_for(numel), 256, 0, stream>>>(g, u, static_cast<T*>(y), numel);
    } else {
      glu_fwd_kernel<1, T><<<grid_for(numel), 256, 0, stream>>>(g, u, static_cast<T*>(y), numel);
    }
    return cudaGetLastError();
  });
}

cudaError_t glu_bwd_cuda(GluKind kind, const void* dy, const void* gate, const void* up, void* dgate, void* dup,
                         int64_t numel, DType dtype, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  return cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto d = static_cast<const T*>(dy);
    const auto g = static_cast<const T*>(gate);
    const auto u = static_cast<const T*>(up);
    if (kind == GluKind::kSilu) {
      glu_bwd_kernel<0, T><<<grid_for(numel), 256, 0, stream>>>(d, g, u, static_cast<T*>(dgate),
                                                                static_cast<T*>(dup), numel);
    } else {
      glu_bwd_kernel<1, T><<<grid_for(numel), 256, 0, stream>>>(d, g, u, static_cast<T*>(dgate),
                                                                static_cast<T*>(dup), numel);
    }
    return cudaGetLastError();
  });
}

}  // namespace shardkit
