// CUDA torch glue for RoPE: registers shardkit_C::rope_fwd for the CUDA key (CUDA torch only).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "rope_args.h"
#include "rope_cuda.h"
#include "shardkit/torch_cuda_utils.h"

namespace shardkit {
namespace {

// pos: contiguous int64 (B, T) from rope_fwd_cuda_op, or none with cos/sin (1 or B, T, D).
at::Tensor rope_apply_cuda(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                           const std::optional<at::Tensor>& pos, bool backward) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "shardkit_C::rope: q/k must be (B, H, T, D) with even D");
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  RopeCudaShape shape{xc.size(0), xc.size(1), xc.size(2), xc.size(3), xc.stride(0), xc.stride(1), xc.stride(2), 1};
  TORCH_CHECK(c.size(-1) == shape.D, "shardkit_C::rope: cos last dim ", c.size(-1), " != head_dim ", shape.D);
  if (pos.has_value()) {
    TORCH_CHECK(pos->sizes() == at::IntArrayRef({shape.B, shape.T}), "shardkit_C::rope: q/k ", x.sizes(),
                " do not match position_ids (B, T) = ", pos->sizes());
  } else {
    TORCH_CHECK(c.dim() == 3 && c.size(1) == shape.T && (c.size(0) == 1 || c.size(0) == shape.B),
                "shardkit_C::rope: cos must be (1 or B, T, D) without position_ids, got ", c.sizes());
    shape.cs_batch = c.size(0);
  }
  at::Tensor y = at::empty({shape.B, shape.H, shape.T, shape.D}, xc.options());
  check_cuda(rope_cuda(xc.data_ptr(), y.data_ptr(), c.data_ptr(), s.data_ptr(),
                       pos.has_value() ? pos->data_ptr<int64_t>() : nullptr, shape, backward,
                       to_dtype(xc, "shardkit_C::rope"), to_dtype(c, "shardkit_C::rope"), current_stream(xc)),
             "shardkit_C::rope");
  return y;
}

// NOTE: position values are not bounds-checked here: that needs their max on the host, a sync per call.
// shardkit.ops.rope queues the check on the GPU with torch._assert_async before calling this.
std::tuple<at::Tensor, at::Tensor> rope_fwd_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin, const std::optional<at::Tensor>& pos,
                                                    bool backward) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_rope_args(q, cos, sin, pos.has_value());
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = sin.contiguous();
  std::optional<at::Tensor> p;
  if (pos.has_value()) {  // (T,), (1, T) or (B, T): the kernel reads pos[b*T + t] of a contiguous (B, T)
    TORCH_CHECK(pos->dim() <= 2, "shardkit_C::rope: position_ids must broadcast to (B, T), got ", pos->sizes());
    p = pos->expand({q.size(0), q.size(2)}).to(at::kLong).contiguous();
  }
  return {rope_apply_cuda(q, c, s, p, backward), rope_apply_cuda(k, c, s, p, backward)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) { m.impl("rope_fwd", &shardkit::rope_fwd_cuda_op); }
