// CUDA torch glue for SwiGLU / GeGLU: registers shardkit_C::{swiglu,geglu}_{fwd,bwd,bwd_inplace} for the CUDA
// key (CUDA torch only).
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

#include "shardkit/torch_cuda_utils.h"
#include "swiglu_args.h"
#include "swiglu_cuda.h"

namespace shardkit {
namespace {

const char* glu_name(GluKind kind, int which) {
  static const char* names[2][3] = {
      {"shardkit_C::swiglu_fwd", "shardkit_C::swiglu_bwd", "shardkit_C::swiglu_bwd_inplace"},
      {"shardkit_C::geglu_fwd", "shardkit_C::geglu_bwd", "shardkit_C::geglu_bwd_inplace"}};
  return names[static_cast<int>(kind)][which];
}

template <GluKind K>
at::Tensor glu_fwd_cuda_op(const at::Tensor& gate, const at::Tensor& up) {
  const char* op = glu_name(K, 0);
  check_swiglu_args(gate, up, nullptr, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor y = at::empty_like(g);
  check_cuda(glu_fwd_cuda(K, g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), to_dtype(g, op),
                          current_stream(g)),
             op);
  return y;
}

template <GluKind K>
std::tuple<at::Tensor, at::Tensor> glu_bwd_cuda_op(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  const char* op = glu_name(K, 1);
  check_swiglu_args(gate, up, &grad, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor d = grad.contiguous();
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor dg = at::empty_like(g);
  at::Tensor du = at::empty_like(u);
  check_cuda(glu_bwd_cuda(K, d.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(), g.numel(),
                          to_dtype(g, op), current_stream(g)),
             op);
  return {dg, du};
}

template <GluKind K>
void glu_bwd_inplace_cuda_op(const at::Tensor& grad, at::Tensor& gate, at::Tensor& up) {
  const char* op = glu_name(K, 2);
  check_swiglu_args(gate, up, &grad, op);
  check_inplace_args(gate, up, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor d = grad.contiguous();
  check_cuda(glu_bwd_cuda(K, d.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.data_ptr(), up.data_ptr(),
                          gate.numel(), to_dtype(gate, op), current_stream(gate)),
             op);
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) {
  using shardkit::GluKind;
  m.impl("swiglu_fwd", &shardkit::glu_fwd_cuda_op<GluKind::kSilu>);
  m.impl("swiglu_bwd", &shardkit::glu_bwd_cuda_op<GluKind::kSilu>);
  m.impl("swiglu_bwd_inplace", &shardkit::glu_bwd_inplace_cuda_op<GluKind::kSilu>);
  m.impl("geglu_fwd", &shardkit::glu_fwd_cuda_op<GluKind::kGeluTanh>);
  m.impl("geglu_bwd", &shardkit::glu_bwd_cuda_op<GluKind::kGeluTanh>);
  m.impl("geglu_bwd_inplace", &shardkit::glu_bwd_inplace_cuda_op<GluKind::kGeluTanh>);
}
