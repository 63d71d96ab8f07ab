// Argument checks of shardkit_C::rope_fwd shared by the CPU binding (rope.cpp) and the CUDA one
// (rope_cuda_binding.cpp), run before either kernel reads a table.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace shardkit {

// q is (B, H, T, D); cos and sin agree in dtype and shape; with position ids they are the (max_position, D) table.
inline void check_rope_args(const at::Tensor& q, const at::Tensor& cos, const at::Tensor& sin, bool has_positions) {
  TORCH_CHECK(q.dim() == 4, "shardkit_C::rope: q/k must be (B, H, T, D), got ", q.sizes());
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && cos.sizes() == sin.sizes(),
              "shardkit_C::rope: cos and sin dtypes or shapes differ");
  TORCH_CHECK(!has_positions || cos.dim() == 2,
              "shardkit_C::rope: with position_ids cos/sin must be (max_position, D), got ", cos.sizes());
}

// position_ids of any shape that broadcasts to (B, T): (T,), (1, T) (what Hugging Face builds) or (B, T).
inline void check_rope_positions(const at::Tensor& position_ids, int64_t B, int64_t T) {
  bool broadcasts = position_ids.dim() <= 2;
  for (int64_t i = 0; broadcasts && i < position_ids.dim(); ++i) {
    const int64_t n = position_ids.size(position_ids.dim() - 1 - i);
    broadcasts = n == 1 || n == (i == 0 ? T : B);
  }
  TORCH_CHECK(broadcasts, "shardkit_C::rope: position_ids of shape ", position_ids.sizes(),
              " do not broadcast to (B, T) = (", B, ", ", T, "); pass (T,), (1, T) or (B, T)");
}

// One of q/k (x, (B, H, T, D) with a contiguous last dim after the caller's copy) against the cos table c and the
// (B, T) int64 positions pos, if any; returns the batch rows of cos/sin (1 or B; 1 when indexed by positions).
inline int64_t check_rope_apply_args(const at::Tensor& x, const at::Tensor& c, const std::optional<at::Tensor>& pos) {
  TORCH_CHECK(x.dim() == 4, "shardkit_C::rope: q/k must be (B, H, T, D), got ", x.sizes());
  TORCH_CHECK(x.size(3) % 2 == 0, "shardkit_C::rope: head_dim ", x.size(3), " must be even");
  TORCH_CHECK(c.size(-1) == x.size(3), "shardkit_C::rope: cos last dim ", c.size(-1), " != head_dim ", x.size(3));
  if (pos.has_value()) {
    TORCH_CHECK(pos->sizes() == at::IntArrayRef({x.size(0), x.size(2)}), "shardkit_C::rope: q/k ", x.sizes(),
                " do not match position_ids (B, T) = ", pos->sizes());
    return 1;
  }
  TORCH_CHECK(c.dim() == 3 && c.size(1) == x.size(2) && (c.size(0) == 1 || c.size(0) == x.size(0)),
              "shardkit_C::rope: cos must be (1 or B, T, D) without position_ids, got ", c.sizes());
  return c.size(0);
}

}  // namespace shardkit
