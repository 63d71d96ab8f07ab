// SwiGLU / GeGLU CUDA launchers: raw pointers, element count, storage dtype and stream; no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shardkit/cuda_common.h"

namespace shardkit {

// The activation of y = act(gate) * up: silu (SwiGLU) or gelu with the tanh approximation (GeGLU).
enum class GluKind : int { kSilu = 0, kGeluTanh = 1 };

cudaError_t glu_fwd_cuda(GluKind kind, const void* gate, const void* up, void* y, int64_t numel, DType dtype,
                         cudaStream_t stream);
// dgate may equal gate and dup may equal up (the in-place backward).
cudaError_t glu_bwd_cuda(GluKind kind, const void* dy, const void* gate, const void* up, void* dgate, void* dup,
                         int64_t numel, DType dtype, cudaStream_t stream);

}  // namespace shardkit
