// Argument checks of shardkit_C::swiglu_{fwd,bwd}, shared by the CPU binding (swiglu.cpp) and the CUDA one
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

}  // namespace shardkit
