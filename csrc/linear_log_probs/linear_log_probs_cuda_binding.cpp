// CUDA torch glue of the chunked log-probabilities: registers shardkit_C::llp_fwd and shardkit_C::llp_bwd for the
// CUDA key (CUDA torch only). The chunk loop is the fused cross-entropy's (matmuls through cuBLAS); the row passes
// are llp_rows_fwd_cuda / llp_rows_bwd_cuda. Labels need no check here (see linear_log_probs_args.h).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../fused_linear_cross_entropy/flce_chunk_loop.h"
#include "linear_log_probs_args.h"
#include "linear_log_probs_cuda.h"
#include "shardkit/torch_cuda_utils.h"

namespace shardkit {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_fwd_cuda_op(const at::Tensor& hidden, const at::Tensor& weight,
                                                               const at::Tensor& labels,
                                                               const std::optional<at::Tensor>& bias, double softcap,
                                                               double inv_temp, int64_t chunk_rows,
                                                               bool want_entropy) {
  constexpr const char* op = "shardkit_C::llp_fwd";
  const int64_t n = llp_check_inputs(hidden, weight, labels, bias, chunk_rows, op);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor lab = labels.contiguous();
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor target = at::empty({n}, f32);
  at::Tensor m = at::empty({want_entropy ? n : 0}, f32);
  flce_chunk_loop(hidden.contiguous(), weight.contiguous(), bias, chunk_rows, false, false, false, lse,
                  [&](at::Tensor& z, int64_t s, int64_t e) {
                    check_cuda(llp_rows_fwd_cuda(z.data_ptr(), to_dtype(z, op), e - s, z.size(1), z.stride(0),
                                                 lab.data_ptr<int64_t>() + s, static_cast<float>(softcap),
                                                 static_cast<float>(inv_temp), lse.data_ptr<float>() + s,
                                                 target.data_ptr<float>() + s,
                                                 want_entropy ? m.data_ptr<float>() + s : nullptr, current_stream(z)),
                               op);
                  },
                  [](at::Tensor& dst, const at::Tensor& src) { dst.add_(src); });
  return {lse, target, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_bwd_cuda_op(
    const at::Tensor& grad_lp, const at::Tensor& grad_ent, const at::Tensor& hidden, const at::Tensor& weight,
    const at::Tensor& labels, const std::optional<at::Tensor>& bias, const at::Tensor& lse, const at::Tensor& m,
    double softcap, double inv_temp, int64_t chunk_rows, bool need_hidden, bool need_weight, bool need_bias) {
  constexpr const char* op = "shardkit_C::llp_bwd";
  const int64_t n = llp_check_inputs(hidden, weight, labels, bias, chunk_rows, op);
  llp_check_backward(grad_lp, grad_ent, lse, m, hidden, n, op);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor lab = labels.contiguous(), gl = grad_lp.contiguous(), ge = grad_ent.contiguous();
  const at::Tensor ls = lse.contiguous(), mm = m.contiguous();
  const bool ent = ge.numel() > 0;
  at::Tensor unused = at::empty({0}, hidden.options().dtype(at::kFloat));
  auto out = flce_chunk_loop(
      hidden.contiguous(), weight.contiguous(), bias, chunk_rows, need_hidden, need_weight, need_bias, unused,
      [&](at::Tensor& z, int64_t s, int64_t e) {
        check_cuda(llp_rows_bwd_cuda(z.data_ptr(), to_dtype(z, op), e - s, z.size(1), z.stride(0),
                                     lab.data_ptr<int64_t>() + s, gl.data_ptr<float>() + s,
                                     ent ? ge.data_ptr<float>() + s : nullptr, ls.data_ptr<float>() + s,
                                     ent ? mm.data_ptr<float>() + s : nullptr, static_cast<float>(softcap),
                                     static_cast<float>(inv_temp), current_stream(z)),
                   op);
      },
      [](at::Tensor& dst, const at::Tensor& src) { dst.add_(src); });
  return {std::get<1>(out), std::get<2>(out), std::get<3>(out)};
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) {
  m.impl("llp_fwd", &shardkit::llp_fwd_cuda_op);
  m.impl("llp_bwd", &shardkit::llp_bwd_cuda_op);
}
