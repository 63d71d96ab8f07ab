// Argument checks of shardkit_C::flce_rows_ and shardkit_C::flce_chunked, shared by the CPU binding
// (fused_linear_cross_entropy.cpp) and the CUDA one (fused_linear_cross_entropy_cuda_binding.cpp). Label VALUES
// are checked by each device's row pass (CPU, while it runs) or before it (CUDA, one sync per call).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace shardkit {

// The logits a row pass works on in place: 2-D float32, bfloat16 or float16 with contiguous rows (16-bit ones
// get fp32 math inside and the gradient rounded back to their dtype).
inline void check_flce_logits(const at::Tensor& logits, const char* op) {
  const auto dt = logits.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              op, ": logits must be a 2-D float32, bfloat16 or float16 tensor with contiguous rows, got ", dt, " ",
              logits.sizes());
}

// flce_rows_: int64 labels and the optional row scale have one entry per row of the logits, on their device.
inline void check_flce_rows_args(const at::Tensor& logits, const at::Tensor& labels,
                                 const std::optional<at::Tensor>& row_scale, const char* op) {
  check_flce_logits(logits, op);
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == logits.size(0) &&
                  labels.device() == logits.device(),
              op, ": labels must be int64 on the logits' device with one entry per row (", logits.size(0), ")");
  const bool scale_ok =
      !row_scale.has_value() || (row_scale->numel() == logits.size(0) && row_scale->device() == logits.device());
  TORCH_CHECK(scale_ok, op, ": row_scale needs one value per row (", logits.size(0), ") on the logits' device");
}

// flce_chunked: the checks made on every device before the chunk loop.
inline void flce_check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                              const at::Tensor& row_scale, int64_t chunk_rows, const char* op) {
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": hidden is ", hidden.scalar_type(),
              " but weight is ", weight.scalar_type(), "; cast them to one dtype");
  TORCH_CHECK(hidden.device() == weight.device() && labels.device() == hidden.device() &&
                  row_scale.device() == hidden.device(),
              op, ": hidden, weight, labels and row_scale must be on one device");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), op,
              ": hidden (N, H) and weight (V, H) must share H; got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == hidden.size(0), op,
              ": labels must be int64 with one entry per row of hidden (", hidden.size(0), ")");
  TORCH_CHECK(row_scale.numel() == hidden.size(0), op, ": row_scale needs one value per row (", hidden.size(0), ")");
  TORCH_CHECK(chunk_rows > 0, op, ": chunk_rows must be positive, got ", chunk_rows);
}

}  // namespace shardkit
