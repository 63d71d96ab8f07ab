// Torch binding + CPU kernels of the chunked log-probabilities in the shardkit_C op namespace.
//
//   llp_fwd  the chunk loop of forward: per row (lse, target, m) of softcap(hidden @ weight^T + bias) / T, m empty
//            unless want_entropy; only one (chunk_rows, V) block of logits ever exists.
//   llp_bwd  the chunk loop of backward: each chunk's logits recomputed, overwritten by their gradient
//            (linear_log_probs_cpu.h) and folded into grad_hidden / grad_weight / grad_bias.
// Both run the fused cross-entropy's chunk loop (flce_chunk_loop.h: matmuls through MKL, one reused logits buffer,
// bf16 grad_weight folded in bf16, fp16 into an fp32 accumulator), so the two ops hold memory the same way.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../fused_linear_cross_entropy/flce_chunk_loop.h"
#include "../fused_linear_cross_entropy/fused_linear_cross_entropy_cpu.h"  // flce_add_into_f32
#include "linear_log_probs_args.h"
#include "linear_log_probs_cpu.h"

namespace shardkit {
namespace {

void add_into(at::Tensor& dst, const at::Tensor& src, const char* op) {
  dispatch_float_types(src, op, [&](auto tag) {
    using T = decltype(tag);
    flce_add_into_f32<T>(dst.data_ptr<float>(), ptr<T>(src), src.numel());
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_fwd(const at::Tensor& hidden, const at::Tensor& weight,
                                                       const at::Tensor& labels, const std::optional<at::Tensor>& bias,
                                                       double softcap, double inv_temp, int64_t chunk_rows,
                                                       bool want_entropy) {
  constexpr const char* op = "shardkit_C::llp_fwd";
  const int64_t n = llp_check_inputs(hidden, weight, labels, bias, chunk_rows, op);
  const at::Tensor lab = labels.contiguous();
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor target = at::empty({n}, f32);
  at::Tensor m = at::empty({want_entropy ? n : 0}, f32);
  const LlpRowParams p{static_cast<float>(softcap), static_cast<float>(inv_temp)};
  flce_chunk_loop(hidden.contiguous(), weight.contiguous(), bias, chunk_rows, false, false, false, lse,
                  [&](at::Tensor& z, int64_t s, int64_t e) {
                    dispatch_float_types(z, op, [&](auto tag) {
                      using T = decltype(tag);
                      llp_rows_forward_cpu(ptr<T>(z), e - s, z.size(1), z.stride(0), lab.data_ptr<int64_t>() + s, p,
                                           lse.data_ptr<float>() + s, target.data_ptr<float>() + s,
                                           want_entropy ? m.data_ptr<float>() + s : nullptr);
                    });
                  },
                  [&](at::Tensor& dst, const at::Tensor& src) { add_into(dst, src, op); });
  return {lse, target, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_bwd(
    const at::Tensor& grad_lp, const at::Tensor& grad_ent, const at::Tensor& hidden, const at::Tensor& weight,
    const at::Tensor& labels, const std::optional<at::Tensor>& bias, const at::Tensor& lse, const at::Tensor& m,
    double softcap, double inv_temp, int64_t chunk_rows, bool need_hidden, bool need_weight, bool need_bias) {
  constexpr const char* op = "shardkit_C::llp_bwd";
  const int64_t n = llp_check_inputs(hidden, weight, labels, bias, chunk_rows, op);
  llp_check_backward(grad_lp, grad_ent, lse, m, hidden, n, op);
  const at::Tensor lab = labels.contiguous(), gl = grad_lp.contiguous(), ge = grad_ent.contiguous();
  const at::Tensor ls = lse.contiguous(), mm = m.contiguous();
  const bool ent = ge.numel() > 0;
  const LlpRowParams p{static_cast<float>(softcap), static_cast<float>(inv_temp)};
  at::Tensor unused = at::empty({0}, hidden.options().dtype(at::kFloat));
  auto out = flce_chunk_loop(
      hidden.contiguous(), weight.contiguous(), bias, chunk_rows, need_hidden, need_weight, need_bias, unused,
      [&](at::Tensor& z, int64_t s, int64_t e) {
        dispatch_float_types(z, op, [&](auto tag) {
          using T = decltype(tag);
          llp_rows_backward_cpu(ptr<T>(z), e - s, z.size(1), z.stride(0), lab.data_ptr<int64_t>() + s,
                                gl.data_ptr<float>() + s, ent ? ge.data_ptr<float>() + s : nullptr,
                                ls.data_ptr<float>() + s, ent ? mm.data_ptr<float>() + s : nullptr, p);
        });
      },
      [&](at::Tensor& dst, const at::Tensor& src) { add_into(dst, src, op); });
  return {std::get<1>(out), std::get<2>(out), std::get<3>(out)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def(
      "llp_fwd(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, float softcap, float inv_temp, "
      "int chunk_rows, bool want_entropy) -> (Tensor, Tensor, Tensor)");
  m.def(
      "llp_bwd(Tensor grad_lp, Tensor grad_ent, Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, "
      "Tensor lse, Tensor m, float softcap, float inv_temp, int chunk_rows, bool need_hidden, bool need_weight, "
      "bool need_bias) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) {
  m.impl("llp_fwd", &shardkit::llp_fwd);
  m.impl("llp_bwd", &shardkit::llp_bwd);
}
