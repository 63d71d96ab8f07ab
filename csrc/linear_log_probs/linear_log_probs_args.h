// Argument checks of shardkit_C::llp_fwd and shardkit_C::llp_bwd, shared by the CPU binding (linear_log_probs.cpp)
// and the CUDA one (linear_log_probs_cuda_binding.cpp): every per-row tensor a row pass reads through a raw pointer
// must hold one fp32 value per row on the inputs' device, or a kernel would read past it. Label values are not
// checked: a label outside [0, V) means "not among these columns" (see linear_log_probs_cpu.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "shardkit/torch_checks.h"

namespace shardkit {

// hidden (N, H), weight (V, H) of one float dtype, int64 labels (N), an optional bias (V); returns N.
inline int64_t llp_check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias, int64_t chunk_rows, const char* op) {
  check_same(hidden, weight, op, "hidden", "weight");
  const auto dt = hidden.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": unsupported dtype ", dt,
              "; use float32, bfloat16 or float16 (float64 runs the reference backend)");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), op,
              ": hidden (N, H) and weight (V, H) must share H; got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == hidden.size(0) &&
                  labels.device() == hidden.device(),
              op, ": labels must be int64 on hidden's device with one entry per row of hidden (", hidden.size(0),
              ")");
  if (bias.has_value()) {
    check_same(*bias, weight, op, "bias", "weight");
    TORCH_CHECK(bias->numel() == weight.size(0), op, ": bias needs one value per row of weight (", weight.size(0),
                "), got ", bias->numel());
  }
  TORCH_CHECK(chunk_rows > 0, op, ": chunk_rows must be positive, got ", chunk_rows);
  return hidden.size(0);
}

// A per-row fp32 statistic or upstream gradient: n values (or, where allow_empty, none) on hidden's device.
inline void llp_check_rows(const at::Tensor& t, int64_t n, bool allow_empty, const at::Tensor& hidden,
                           const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device() == hidden.device() &&
                  (t.numel() == n || (allow_empty && t.numel() == 0)),
              op, ": ", name, " must be float32 on hidden's device with one value per row (", n, ")",
              allow_empty ? " or empty" : "", "; got ", t.scalar_type(), " ", t.sizes());
}

// llp_bwd: grad_lp and lse per row; grad_ent either empty (no entropy term) or per row, and then m per row too.
inline void llp_check_backward(const at::Tensor& grad_lp, const at::Tensor& grad_ent, const at::Tensor& lse,
                               const at::Tensor& m, const at::Tensor& hidden, int64_t n, const char* op) {
  llp_check_rows(grad_lp, n, false, hidden, op, "grad_lp");
  llp_check_rows(lse, n, false, hidden, op, "lse");
  llp_check_rows(grad_ent, n, true, hidden, op, "grad_ent");
  llp_check_rows(m, n, grad_ent.numel() == 0, hidden, op, "m (needed with grad_ent)");
}

}  // namespace shardkit
