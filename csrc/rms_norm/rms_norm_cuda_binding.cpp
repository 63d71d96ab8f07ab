// CUDA torch glue for RMSNorm: registers shardkit_C::rms_norm_{fwd,bwd} for the CUDA key (CUDA torch only).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

#include "rms_norm_args.h"
#include "rms_norm_cuda.h"
#include "shardkit/torch_cuda_utils.h"

namespace shardkit {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda_op(const at::Tensor& x, const at::Tensor& w, double eps,
                                                        double offset) {
  const int64_t rows = check_rms_norm_args(x, w, nullptr, "shardkit_C::rms_norm_fwd");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = w.numel();
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  at::Tensor rstd = at::empty({rows}, xc.options().dtype(at::kFloat));
  check_cuda(rms_norm_fwd_cuda(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), rows, n,
                               static_cast<float>(eps), static_cast<float>(offset),
                               to_dtype(xc, "shardkit_C::rms_norm_fwd"), current_stream(xc)),
             "shardkit_C::rms_norm_fwd");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda_op(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& w, const at::Tensor& rstd, double offset) {
  const int64_t rows = check_rms_norm_args(x, w, &dy, "shardkit_C::rms_norm_bwd");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor dyc = dy.contiguous();
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor rc = rstd.contiguous();
  const int64_t n = w.numel();
  check_rms_norm_rstd(rc, rows, "shardkit_C::rms_norm_bwd");
  at::Tensor dx = at::empty_like(xc);
  at::Tensor dw = at::empty_like(wc);
  const int blocks = rms_norm_bwd_blocks(rows, x.device().index());
  at::Tensor ws = at::empty({blocks, n}, xc.options().dtype(at::kFloat));
  check_cuda(rms_norm_bwd_cuda(dyc.data_ptr(), xc.data_ptr(), wc.data_ptr(), rc.data_ptr<float>(), dx.data_ptr(),
                               dw.data_ptr(), ws.data_ptr<float>(), blocks, rows, n, static_cast<float>(offset),
                               to_dtype(xc, "shardkit_C::rms_norm_bwd"), current_stream(xc)),
             "shardkit_C::rms_norm_bwd");
  return {dx, dw};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) {
  m.impl("rms_norm_fwd", &shardkit::rms_norm_fwd_cuda_op);
  m.impl("rms_norm_bwd", &shardkit::rms_norm_bwd_cuda_op);
}
