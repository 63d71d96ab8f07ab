// Torch binding + CPU kernels of RMSNorm in the shardkit_C op namespace (one source of the one extension).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

#include "rms_norm_args.h"
#include "rms_norm_cpu.h"
#include "shardkit/torch_utils.h"

namespace shardkit {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps,
                                                double offset) {
  const int64_t n = w.numel();
  const int64_t rows = check_rms_norm_args(x, w, nullptr, "shardkit_C::rms_norm_fwd");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor y = empty_output_like(xc);
  at::Tensor rstd = at::empty({rows}, xc.options().dtype(at::kFloat));
  dispatch_float_types(xc, "shardkit_C::rms_norm_fwd", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_fwd_cpu<T>(ptr<T>(xc), ptr<T>(wc), ptr<T>(y), rstd.data_ptr<float>(), rows, n,
                        static_cast<float>(eps), static_cast<float>(offset));
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& rstd, double offset) {
  const int64_t n = w.numel();
  const int64_t rows = check_rms_norm_args(x, w, &dy, "shardkit_C::rms_norm_bwd");
  const at::Tensor dyc = dy.contiguous();
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor rc = rstd.contiguous();
  check_rms_norm_rstd(rc, rows, "shardkit_C::rms_norm_bwd");
  at::Tensor dx = empty_output_like(xc);
  at::Tensor dw = at::empty_like(wc);
  dispatch_float_types(xc, "shardkit_C::rms_norm_bwd", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_bwd_cpu<T>(ptr<T>(dyc), ptr<T>(xc), ptr<T>(wc), rc.data_ptr<float>(), ptr<T>(dx), ptr<T>(dw), rows,
                        n, static_cast<float>(offset));
  });
  return {dx, dw};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd, float offset) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) {
  m.impl("rms_norm_fwd", &shardkit::rms_norm_fwd);
  m.impl("rms_norm_bwd", &shardkit::rms_norm_bwd);
}
