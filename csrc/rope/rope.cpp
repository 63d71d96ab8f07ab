// Torch binding + CPU kernels of rotary embedding in the shardkit_C op namespace.
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <optional>

#include "rope_args.h"
#include "rope_cpu.h"
#include "shardkit/torch_utils.h"

namespace shardkit {
namespace {

// position_ids of any shape that broadcasts to (B, T), e.g. (T,), (1, T) (what Hugging Face builds) or (B, T), as
// contiguous int64 (B, T). The kernels read cos/sin row pos[b*T + t] unchecked, so every position must be a row of
// the (rows, D) table; on CPU checking that is one pass over B*T ints next to B*H*T*D elements of work.
at::Tensor positions_cpu(const at::Tensor& position_ids, int64_t B, int64_t T, int64_t rows) {
  check_rope_positions(position_ids, B, T);
  at::Tensor pos = position_ids.expand({B, T}).to(at::kLong).contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < pos.numel(); ++i) {
    lo = i == 0 || p[i] < lo ? p[i] : lo;
    hi = i == 0 || p[i] > hi ? p[i] : hi;
  }
  TORCH_CHECK_INDEX(pos.numel() == 0 || hi < rows, "shardkit_C::rope: position_ids max ", hi,
                    " >= cos/sin table length ", rows, ": build the rotary table for at least ", hi + 1, " positions");
  TORCH_CHECK_INDEX(lo >= 0, "shardkit_C::rope: position_ids min ", lo, " < 0");
  return pos;
}

// x: (B, H, T, D) with a contiguous last dim (q or k, any other strides, e.g. HF's transposed view);
// cos/sin: (cs_batch, T, D), or (max_pos, D) with pos (int64 (B, T) from positions_cpu); float32 or x's dtype.
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                      const std::optional<at::Tensor>& pos, bool backward) {
  const int64_t cs_batch = check_rope_apply_args(x, c, pos);
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  const RopeShape shape{xc.size(0),   xc.size(1),   xc.size(2),   xc.size(3),
                        xc.stride(0), xc.stride(1), xc.stride(2), cs_batch};
  const int64_t* pos_ptr = pos.has_value() ? pos->const_data_ptr<int64_t>() : nullptr;
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
  check_rope_args(q, cos, sin, position_ids.has_value());
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = sin.contiguous();
  std::optional<at::Tensor> pos;
  if (position_ids.has_value()) {
    pos = positions_cpu(*position_ids, q.size(0), q.size(2), c.size(0));
  }
  return {rope_apply(q, c, s, pos, backward), rope_apply(k, c, s, pos, backward)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  // backward=True applies the transpose of the rotation (the gradient); one kernel serves both directions.
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, bool backward) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) { m.impl("rope_fwd", &shardkit::rope_fwd); }
