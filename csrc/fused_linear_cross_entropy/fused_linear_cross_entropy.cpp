// Torch binding + CPU kernels of fused linear cross-entropy in the shardkit_C op namespace.
//
//   flce_rows_   the fused row pass (softcap, log-sum-exp, loss, gradient) in place on a chunk of logits (fp32,
//                or 16-bit with fp32 math inside).
//   flce_chunked the whole chunk loop (flce_chunk_loop.h) with this row pass: only a (chunk_rows, V) block of
//                logits ever exists; grad_weight and grad_bias come back as fp32 accumulators.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "flce_chunk_loop.h"
#include "fused_linear_cross_entropy_args.h"
#include "fused_linear_cross_entropy_cpu.h"

namespace shardkit {
namespace {

// Runs the row pass; raises naming the row when a label is outside [0, V) and not ignore_index.
void row_pass(at::Tensor& logits, const at::Tensor& labels, const float* scale, float* loss, int64_t row0,
              const FlceRowParams& p, const char* op) {
  check_flce_logits(logits, op);
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.is_contiguous() && labels.numel() == logits.size(0), op,
              ": labels must be contiguous int64 with one entry per row (", logits.size(0), ")");
  int64_t bad = -1;
  dispatch_float_types(logits, op, [&](auto tag) {
    using T = decltype(tag);
    bad = flce_rows_cpu(ptr<T>(logits), logits.size(0), logits.size(1), logits.stride(0),
                        labels.data_ptr<int64_t>(), scale, loss, p);
  });
  TORCH_CHECK(bad < 0, op, ": label ", labels.data_ptr<int64_t>()[bad < 0 ? 0 : bad], " at row ", row0 + bad,
              " is outside [0, ", logits.size(1), ") and is not ignore_index (", p.ignore_index, ")");
}

at::Tensor flce_rows_(at::Tensor logits, const at::Tensor& labels, const std::optional<at::Tensor>& row_scale,
                      int64_t ignore_index, double label_smoothing, double softcap, bool write_grad) {
  constexpr const char* op = "shardkit_C::flce_rows_";
  check_flce_rows_args(logits, labels, row_scale, op);
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  const float* scale = nullptr;
  at::Tensor sc;
  if (row_scale.has_value()) {
    sc = row_scale->to(at::kFloat).contiguous();
    scale = sc.data_ptr<float>();
  }
  const FlceRowParams p{ignore_index, static_cast<float>(label_smoothing), static_cast<float>(softcap), write_grad};
  row_pass(logits, labels.contiguous(), scale, loss.data_ptr<float>(), 0, p, op);
  return loss;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_chunked(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& bias,
    const at::Tensor& row_scale, int64_t ignore_index, double label_smoothing, double softcap, int64_t chunk_rows,
    bool need_hidden, bool need_weight, bool need_bias) {
  constexpr const char* op = "shardkit_C::flce_chunked";
  flce_check_inputs(hidden, weight, labels, row_scale, chunk_rows, op);
  const at::Tensor lab = labels.contiguous();
  const at::Tensor scale = row_scale.to(at::kFloat).contiguous();
  at::Tensor loss = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
  const FlceRowParams p{ignore_index, static_cast<float>(label_smoothing), static_cast<float>(softcap),
                        need_hidden || need_weight || need_bias};
  return flce_chunk_loop(hidden.contiguous(), weight.contiguous(), bias, chunk_rows, need_hidden, need_weight,
                         need_bias, loss,
                         [&](at::Tensor& z, int64_t s, int64_t e) {
                           row_pass(z, lab.slice(0, s, e), scale.data_ptr<float>() + s,
                                    loss.data_ptr<float>() + s, s, p, op);
                         },
                         [&](at::Tensor& dst, const at::Tensor& src) {
                           dispatch_float_types(src, op, [&](auto tag) {
                             using T = decltype(tag);
                             flce_add_into_f32<T>(dst.data_ptr<float>(), ptr<T>(src), src.numel());
                           });
                         });
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def(
      "flce_rows_(Tensor(a!) logits, Tensor labels, Tensor? row_scale, int ignore_index, float label_smoothing, "
      "float softcap, bool write_grad) -> Tensor");
  m.def(
      "flce_chunked(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, Tensor row_scale, int ignore_index, "
      "float label_smoothing, float softcap, int chunk_rows, bool need_hidden, bool need_weight, bool need_bias) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) {
  m.impl("flce_rows_", &shardkit::flce_rows_);
  m.impl("flce_chunked", &shardkit::flce_chunked);
}
