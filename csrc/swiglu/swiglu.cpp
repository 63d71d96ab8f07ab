// Torch binding + CPU kernels of SwiGLU in the shardkit_C op namespace (one source of the one extension).
#include <torch/library.h>

#include <tuple>

#include "shardkit/torch_utils.h"
#include "swiglu_args.h"
#include "swiglu_cpu.h"

namespace shardkit {
namespace {

at::Tensor swiglu_fwd(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu_args(gate, up, nullptr, "shardkit_C::swiglu_fwd");
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor y = empty_output_like(g);
  dispatch_float_types(g, "shardkit_C::swiglu_fwd", [&](auto tag) {
    using T = decltype(tag);
    swiglu_fwd_cpu<T>(ptr<T>(g), ptr<T>(u), ptr<T>(y), g.numel());
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& grad, const at::Tensor& gate,
                                              const at::Tensor& up) {
  check_swiglu_args(gate, up, &grad, "shardkit_C::swiglu_bwd");
  const at::Tensor d = grad.contiguous();
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor dg = empty_output_like(g);
  at::Tensor du = empty_output_like(u);
  dispatch_float_types(g, "shardkit_C::swiglu_bwd", [&](auto tag) {
    using T = decltype(tag);
    swiglu_bwd_cpu<T>(ptr<T>(d), ptr<T>(g), ptr<T>(u), ptr<T>(dg), ptr<T>(du), g.numel());
  });
  return {dg, du};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) {
  m.impl("swiglu_fwd", &shardkit::swiglu_fwd);
  m.impl("swiglu_bwd", &shardkit::swiglu_bwd);
}
