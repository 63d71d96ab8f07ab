// Argument checks of shardkit_C::{swiglu,geglu}_{fwd,bwd,bwd_inplace}, shared by the CPU binding (swiglu.cpp) and the CUDA one
// (swiglu_cuda_binding.cpp): both kernels walk numel(gate) elements of every tensor, so all must match.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "shardkit/torch_checks.h"

namespace shardkit {

// gate, up and (in backward, non-null) the upstream gradient share one shape, dtype and device.
inline void check_swiglu_args(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* grad, const char* op) {
  check_same(gate, up, op, "gate", "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), op, ": gate ", gate.sizes(), " != up ", up.sizes());
  if (grad != nullptr) {
    check_same(gate, *grad, op, "gate", "grad_output");
    TORCH_CHECK(grad->sizes() == gate.sizes(), op, ": grad_output ", grad->sizes(), " != gate ", gate.sizes());
  }
}

// The in-place backward writes over gate and up: both must be contiguous (no copy to write into) and distinct
// memory (the gradient of one would overwrite the other's input).
inline void check_inplace_args(const at::Tensor& gate, const at::Tensor& up, const char* op) {
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous(), op,
              ": gate and up must be contiguous to take their gradients in place; call the out-of-place backward");
  const auto g0 = static_cast<const char*>(gate.data_ptr());
  const auto u0 = static_cast<const char*>(up.data_ptr());
  const auto bytes = static_cast<int64_t>(gate.numel() * gate.element_size());
  TORCH_CHECK(bytes == 0 || g0 + bytes <= u0 || u0 + bytes <= g0, op,
              ": gate and up overlap in memory; the in-place backward needs two distinct buffers");
}

}  // namespace shardkit
