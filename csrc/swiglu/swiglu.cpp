// Torch binding + CPU kernels of SwiGLU and GeGLU in the shardkit_C op namespace (one source of the one
// extension). The *_bwd_inplace kernels write d gate over gate and d up over up (see swiglu_cpu.h).
#include <torch/library.h>

#include <tuple>

#include "shardkit/torch_utils.h"
#include "swiglu_args.h"
#include "swiglu_cpu.h"

namespace shardkit {
namespace {

template <GluAct A>
at::Tensor glu_fwd(const at::Tensor& gate, const at::Tensor& up) {
  const char* op = A == GluAct::kSilu ? "shardkit_C::swiglu_fwd" : "shardkit_C::geglu_fwd";
  check_swiglu_args(gate, up, nullptr, op);
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor y = empty_output_like(g);
  dispatch_float_types(g, op, [&](auto tag) {
    using T = decltype(tag);
    glu_fwd_cpu<A, T>(ptr<T>(g), ptr<T>(u), ptr<T>(y), g.numel());
  });
  return y;
}

template <GluAct A>
void glu_bwd_into(const at::Tensor& d, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg, at::Tensor& du,
                  const char* op) {
  dispatch_float_types(g, op, [&](auto tag) {
    using T = decltype(tag);
    glu_bwd_cpu<A, T>(ptr<T>(d), ptr<T>(g), ptr<T>(u), ptr<T>(dg), ptr<T>(du), g.numel());
  });
}

template <GluAct A>
std::tuple<at::Tensor, at::Tensor> glu_bwd(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  const char* op = A == GluAct::kSilu ? "shardkit_C::swiglu_bwd" : "shardkit_C::geglu_bwd";
  check_swiglu_args(gate, up, &grad, op);
  const at::Tensor d = grad.contiguous();
  const at::Tensor g = gate.contiguous();
  const at::Tensor u = up.contiguous();
  at::Tensor dg = empty_output_like(g);
  at::Tensor du = empty_output_like(u);
  glu_bwd_into<A>(d, g, u, dg, du, op);
  return {dg, du};
}

template <GluAct A>
void glu_bwd_inplace(const at::Tensor& grad, at::Tensor& gate, at::Tensor& up) {
  const char* op = A == GluAct::kSilu ? "shardkit_C::swiglu_bwd_inplace" : "shardkit_C::geglu_bwd_inplace";
  check_swiglu_args(gate, up, &grad, op);
  check_inplace_args(gate, up, op);
  const at::Tensor d = grad.contiguous();
  glu_bwd_into<A>(d, gate, up, gate, up, op);
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("swiglu_bwd_inplace(Tensor grad_out, Tensor(a!) gate, Tensor(b!) up) -> ()");
  m.def("geglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("geglu_bwd(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("geglu_bwd_inplace(Tensor grad_out, Tensor(a!) gate, Tensor(b!) up) -> ()");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) {
  using shardkit::GluAct;
  m.impl("swiglu_fwd", &shardkit::glu_fwd<GluAct::kSilu>);
  m.impl("swiglu_bwd", &shardkit::glu_bwd<GluAct::kSilu>);
  m.impl("swiglu_bwd_inplace", &shardkit::glu_bwd_inplace<GluAct::kSilu>);
  m.impl("geglu_fwd", &shardkit::glu_fwd<GluAct::kGeluTanh>);
  m.impl("geglu_bwd", &shardkit::glu_bwd<GluAct::kGeluTanh>);
  m.impl("geglu_bwd_inplace", &shardkit::glu_bwd_inplace<GluAct::kGeluTanh>);
}
