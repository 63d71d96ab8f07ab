// CUDA torch glue for SwiGLU: registers shardkit_C::swiglu_{fwd,bwd} for the CUDA key (CUDA torch only).
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

#include "shardkit/torch_cuda_utils.h"
#include "swiglu_args.h"
#include "swiglu_cuda.h"

namespace shardkit {
namespace {

at::Tensor swiglu_fwd_cuda_op(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu_args(gate, up, nullptr, "shardkit_C::swiglu_fwd");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor y = at::empty_like(g);
  check_cuda(swiglu_fwd_cuda(g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), to_dtype(g, "swiglu_fwd"),
                             current_stream(g)),
             "shardkit_C::swiglu_fwd");
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cuda_op(const at::Tensor& grad, const at::Tensor& gate,
                                                      const at::Tensor& up) {
  check_swiglu_args(gate, up, &grad, "shardkit_C::swiglu_bwd");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor d = grad.contiguous();
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor dg = at::empty_like(g);
  at::Tensor du = at::empty_like(u);
  check_cuda(swiglu_bwd_cuda(d.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(), g.numel(),
                             to_dtype(g, "swiglu_bwd"), current_stream(g)),
             "shardkit_C::swiglu_bwd");
  return {dg, du};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) {
  m.impl("swiglu_fwd", &shardkit::swiglu_fwd_cuda_op);
  m.impl("swiglu_bwd", &shardkit::swiglu_bwd_cuda_op);
}
