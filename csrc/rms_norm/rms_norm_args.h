// Argument checks of shardkit_C::rms_norm_{fwd,bwd}, shared by the CPU binding (rms_norm.cpp) and the CUDA one
// (rms_norm_cuda_binding.cpp): a weight that does not match x's last dim, or an rstd of the wrong length, would
// make either kernel read past it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "shardkit/torch_checks.h"

namespace shardkit {

// Rows of x seen as (rows, n), n = weight.numel(); checks that x's last dim is n.
inline int64_t rms_norm_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  const int64_t n = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, op, ": x last dim ", x.dim() ? x.size(-1) : 0, " != weight size ",
              n, "; the weight must have one entry per normalised feature");
  return n == 0 ? 0 : x.numel() / n;
}

// x, weight and (in backward, non-null) the upstream gradient share one dtype and device; returns the rows.
inline int64_t check_rms_norm_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor* dy, const char* op) {
  check_same(x, w, op, "x", "weight");
  if (dy != nullptr) {
    check_same(x, *dy, op, "x", "grad_output");
    TORCH_CHECK(dy->sizes() == x.sizes(), op, ": grad_output ", dy->sizes(), " != x ", x.sizes());
  }
  return rms_norm_rows(x, w, op);
}

// The rstd saved by the forward pass: float32, one value per row.
inline void check_rms_norm_rstd(const at::Tensor& rstd, int64_t rows, const char* op) {
  TORCH_CHECK(rstd.numel() == rows && rstd.scalar_type() == at::kFloat, op,
              ": rstd must be float32 with one value per row (", rows, ")");
}

}  // namespace shardkit
