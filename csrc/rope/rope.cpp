// Torch binding + CPU kernels of rotary embedding in the shardkit_C op namespace.
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <optional>

#include "rope_cpu.h"
#include "shardkit/torch_utils.h"

namespace shardkit {
namespace {

// x: (B, H, T, D) with a contiguous last dim (q or k, any other strides, e.g. HF's transposed view);
// cos/sin: (cs_batch, T, D) or (max_pos, D) with position_ids (B, T); cos/sin float32 or x's dtype.
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      const std::optional<at::Tensor>& position_ids, bool backward) {
  TORCH_CHECK(x.dim() == 4, "shardkit_C::rope: q/k must be (B, H, T, D), got ", x.sizes());
  TORCH_CHECK(x.size(3) % 2 == 0, "shardkit_C::rope: head_dim ", x.size(3), " must be even");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "shardkit_C::rope: cos and sin dtypes differ");
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = sin.contiguous();
  RopeShape shape{xc.size(0), xc.size(1), xc.size(2), xc.size(3), xc.stride(0), xc.stride(1), xc.stride(2), 1};
  TORCH_CHECK(c.size(-1) == shape.D, "shardkit_C::rope: cos last dim ", c.size(-1), " != head_dim ", shape.D);
  at::Tensor pos;
  if (position_ids.has_value()) {
    pos = position_ids->to(at::kLong).contiguous();
    TORCH_CHECK(pos.numel() == shape.B * shape.T, "shardkit_C::rope: position_ids must be (B, T)");
  } else {
    TORCH_CHECK(c.dim() == 3 && c.size(1) == shape.T && (c.size(0) == 1 || c.size(0) == shape.B),
                "shardkit_C::rope: cos must be (1 or B, T, D) without position_ids, got ", c.sizes());
    shape.cs_batch = c.size(0);
  }
  const int64_t* pos_ptr = position_ids.has_value() ? pos.data_ptr<int64_t>() : nullptr;
  at::Tensor y = empty_output({shape.B, shape.H, shape.T, shape.D}, xc.options());
  dispatch_float_types(xc, "shardkit_C::rope", [&](auto tag) {
    using T = decltype(tag);
    if (c.scalar_type() == at::kFloat) {
      rope_cpu<T, float>(ptr<T>(xc), ptr<T>(y), ptr<float>(c), ptr<float>(s), pos_ptr, shape, backward);
    } else {
      TORCH_CHECK(c.scalar_type() == xc.scalar_type(), "shardkit_C::rope: cos/sin must be float32 or q's dtype");
      rope_cpu<T, T>(ptr<T>(xc), ptr<T>(y), ptr<T>(c), ptr<T>(s), pos_ptr, shape, backward);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rope_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin, const std::optional<at::Tensor>& position_ids,
                                            bool backward) {
  return {rope_apply(q, cos, sin, position_ids, backward), rope_apply(k, cos, sin, position_ids, backward)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  // backward=True applies the transpose of the rotation (the gradient); one kernel serves both directions.
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool backward) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) { m.impl("rope_fwd", &shardkit::rope_fwd); }
