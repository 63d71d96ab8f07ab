// Argument checks of shardkit_C::rope_fwd shared by the CPU binding (rope.cpp) and the CUDA one
// (rope_cuda_binding.cpp), run before either kernel reads a table.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace shardkit {

// q is (B, H, T, D); cos and sin agree in dtype and shape; with position ids they are the (max_position, D) table.
inline void check_rope_args(const at::Tensor& q, const at::Tensor& cos, const at::Tensor& sin, bool has_positions) {
  TORCH_CHECK(q.dim() == 4, "shardkit_C::rope: q/k must be (B, H, T, D), got ", q.sizes());
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && cos.sizes() == sin.sizes(),
              "shardkit_C::rope: cos and sin dtypes or shapes differ");
  TORCH_CHECK(!has_positions || cos.dim() == 2,
              "shardkit_C::rope: with position_ids cos/sin must be (max_position, D), got ", cos.sizes());
}

}  // namespace shardkit
