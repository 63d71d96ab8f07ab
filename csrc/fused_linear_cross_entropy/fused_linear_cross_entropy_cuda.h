// Torch-free launcher of the fused linear cross-entropy row pass on CUDA (see fused_linear_cross_entropy_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shardkit/cuda_common.h"

namespace shardkit {

// logits: rows x vocab of `dtype` (fp32, bf16, fp16), row stride ld elements, overwritten with
// row_scale[r] * dloss/dz (fp32 math, rounded to nearest even into dtype) when write_grad.
// labels: int64 per row; row_scale: fp32 per row (nullptr: 1); loss: fp32 per row (0 on ignore_index rows).
cudaError_t flce_rows_cuda(void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                           const int64_t* labels, const float* row_scale, float* loss, int64_t ignore_index,
                           float label_smoothing, float softcap, bool write_grad, cudaStream_t stream);

}  // namespace shardkit
