// CUDA torch glue for fused linear cross-entropy: registers shardkit_C::flce_rows_ and shardkit_C::flce_chunked
// for the CUDA key (CUDA torch only). The matmuls stay cuBLAS (at::mm); the row pass is flce_rows_cuda.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "flce_chunk_loop.h"
#include "fused_linear_cross_entropy_args.h"
#include "fused_linear_cross_entropy_cuda.h"
#include "shardkit/torch_cuda_utils.h"

namespace shardkit {
namespace {

// Labels outside [0, V) that are not ignore_index raise naming the first one; costs one device sync per call
// (not per chunk), the price of an error instead of a silent NaN loss.
void check_labels(const at::Tensor& labels, int64_t vocab, int64_t ignore_index, const char* op) {
  const at::Tensor bad = labels.ne(ignore_index).logical_and(labels.lt(0).logical_or(labels.ge(vocab)));
  if (!bad.any().item<bool>()) return;
  const int64_t row = bad.nonzero().select(1, 0).min().item<int64_t>();
  TORCH_CHECK(false, op, ": label ", labels.select(0, row).item<int64_t>(), " at row ", row, " is outside [0, ",
              vocab, ") and is not ignore_index (", ignore_index, ")");
}

void rows_cuda(at::Tensor& z, const at::Tensor& labels, const float* scale, float* loss, int64_t ignore_index,
               double label_smoothing, double softcap, bool write_grad, const char* op) {
  check_flce_logits(z, op);
  check_cuda(flce_rows_cuda(z.data_ptr(), to_dtype(z, op), z.size(0), z.size(1), z.stride(0),
                            labels.data_ptr<int64_t>(), scale, loss, ignore_index, static_cast<float>(label_smoothing),
                            static_cast<float>(softcap), write_grad, current_stream(z)),
             op);
}

at::Tensor flce_rows_cuda_op(at::Tensor logits, const at::Tensor& labels, const std::optional<at::Tensor>& row_scale,
                             int64_t ignore_index, double label_smoothing, double softcap, bool write_grad) {
  constexpr const char* op = "shardkit_C::flce_rows_";
  check_flce_rows_args(logits, labels, row_scale, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor lab = labels.contiguous();
  check_labels(lab, logits.size(1), ignore_index, op);
  at::Tensor sc;
  if (row_scale.has_value()) {
    sc = row_scale->to(at::kFloat).contiguous();
  }
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  rows_cuda(logits, lab, sc.defined() ? sc.data_ptr<float>() : nullptr, loss.data_ptr<float>(), ignore_index,
            label_smoothing, softcap, write_grad, op);
  return loss;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_chunked_cuda_op(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& bias,
    const at::Tensor& row_scale, int64_t ignore_index, double label_smoothing, double softcap, int64_t chunk_rows,
    bool need_hidden, bool need_weight, bool need_bias) {
  constexpr const char* op = "shardkit_C::flce_chunked";
  flce_check_inputs(hidden, weight, labels, row_scale, chunk_rows, op);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor lab = labels.contiguous();
  check_labels(lab, weight.size(0), ignore_index, op);
  const at::Tensor scale = row_scale.to(at::kFloat).contiguous();
  at::Tensor loss = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
  const bool write_grad = need_hidden || need_weight || need_bias;
  return flce_chunk_loop(hidden.contiguous(), weight.contiguous(), bias, chunk_rows, need_hidden, need_weight,
                         need_bias, loss,
                         [&](at::Tensor& z, int64_t s, int64_t e) {
                           const at::Tensor lab_rows = lab.slice(0, s, e);
                           rows_cuda(z, lab_rows, scale.data_ptr<float>() + s, loss.data_ptr<float>() + s,
                                     ignore_index, label_smoothing, softcap, write_grad, op);
                         },
                         [](at::Tensor& dst, const at::Tensor& src) { dst.add_(src); });
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) {
  m.impl("flce_rows_", &shardkit::flce_rows_cuda_op);
  m.impl("flce_chunked", &shardkit::flce_chunked_cuda_op);
}
