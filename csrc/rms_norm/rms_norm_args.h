// Shape check of shardkit_C::rms_norm_{fwd,bwd}, shared by the CPU binding (rms_norm.cpp) and the CUDA one
// (rms_norm_cuda_binding.cpp): a weight that does not match x's last dim would make either kernel read past it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace shardkit {

// Rows of x seen as (rows, n), n = weight.numel(); checks that x's last dim is n.
inline int64_t rms_norm_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  const int64_t n = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, op, ": x last dim ", x.dim() ? x.size(-1) : 0, " != weight size ",
              n, "; the weight must have one entry per normalised feature");
  return n == 0 ? 0 : x.numel() / n;
}

}  // namespace shardkit
