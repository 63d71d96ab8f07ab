// Torch-free launchers of the chunked log-probabilities row passes on CUDA (see linear_log_probs_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shardkit/cuda_common.h"

namespace shardkit {

// logits: rows x vocab of `dtype` (fp32, bf16, fp16), row stride ld elements, read only. labels: int64 per row
// (outside [0, vocab): no target). Writes fp32 lse, target and (m non-null) m per row.
cudaError_t llp_rows_fwd_cuda(const void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                              const int64_t* labels, float softcap, float inv_temp, float* lse, float* target,
                              float* m, cudaStream_t stream);

// Overwrites the logits with the gradient of grad_lp * logp + grad_ent * entropy wrt them (fp32 math, rounded to
// nearest even into dtype). grad_ent and m may be null (no entropy term); lse and m are the rows' statistics.
cudaError_t llp_rows_bwd_cuda(void* logits, DType dtype, int64_t rows, int64_t vocab, int64_t ld,
                              const int64_t* labels, const float* grad_lp, const float* grad_ent, const float* lse,
                              const float* m, float softcap, float inv_temp, cudaStream_t stream);

}  // namespace shardkit
