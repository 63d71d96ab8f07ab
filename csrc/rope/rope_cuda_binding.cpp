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
  const int64_t cs_batch = check_rope_apply_args(x, c, pos);
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  const RopeCudaShape shape{xc.size(0),   xc.size(1),   xc.size(2),   xc.size(3),
                            xc.stride(0), xc.stride(1), xc.stride(2), cs_batch};
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
    check_rope_positions(*pos, q.size(0), q.size(2));
    p = pos->expand({q.size(0), q.size(2)}).to(at::kLong).contiguous();
  }
  return {rope_apply_cuda(q, c, s, p, backward), rope_apply_cuda(k, c, s, p, backward)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) { m.impl("rope_fwd", &shardkit::rope_fwd_cuda_op); }
