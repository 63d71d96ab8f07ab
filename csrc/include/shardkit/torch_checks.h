// Argument checks shared by the CPU bindings (<op>.cpp) and the CUDA ones (<op>_cuda_binding.cpp) through each
// op's <op>_args.h. Torch headers only: no CPU cores, no CUDA runtime.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace shardkit {

inline void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* a_name,
                       const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " is ", a.scalar_type(), " but ", b_name,
              " is ", b.scalar_type(), "; cast them to one dtype");
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " and ", b_name, " are on different devices");
}

}  // namespace shardkit
