// Argument checks of shardkit_C::adamw_step_, shared by the CPU binding (adamw.cpp) and the CUDA one
// (adamw_cuda_binding.cpp). They run before any kernel: an exception must not escape an OpenMP thread,
// and a CUDA launch must never see a tensor of the wrong size or dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace shardkit {
namespace adamw_args {

constexpr const char* kOp = "shardkit_C::adamw_step_";

inline void check_dtype(const at::Tensor& t, const char* name, size_t i) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, kOp, ": ", name, "[", i, "] is ", s,
              "; use float32, bfloat16 or float16");
}

inline void check_state(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, kOp, ": ", name, "[", i, "] must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == p.numel() && t.is_contiguous() && t.device() == p.device(), kOp, ": ", name, "[", i,
              "] must be contiguous with the ", p.numel(), " elements of params[", i, "] on its device");
}

// Every list has one entry per param (masters: none or one per param); every tensor is contiguous, on one
// `device_type` device, of a float dtype, with fp32 states of the param's size on the param's device.
inline void check_all(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList masters, at::ArrayRef<double> step_sizes,
                      at::ArrayRef<double> bc2_sqrts, c10::DeviceType device_type) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && step_sizes.size() == n &&
                  bc2_sqrts.size() == n,
              kOp, ": params, grads, exp_avgs, exp_avg_sqs, step_sizes and bc2_sqrts must have one entry per param (",
              n, ")");
  TORCH_CHECK(masters.empty() || masters.size() == n, kOp, ": masters must be empty or one per param (", n, ")");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.device().type() == device_type && p.is_contiguous(), kOp, ": params[", i,
                "] must be a contiguous ", c10::DeviceTypeName(device_type), " tensor");
    TORCH_CHECK(p.device() == params[0].device(), kOp, ": params[", i, "] is on ", p.device(), " but params[0] on ",
                params[0].device(), "; step each device's tensors in a separate call");
    TORCH_CHECK(grads[i].numel() == p.numel() && grads[i].is_contiguous() && grads[i].device() == p.device(), kOp,
                ": grads[", i, "] must be contiguous with ", p.numel(), " elements on the device of params[", i,
                "]");
    check_dtype(p, "params", i);
    check_dtype(grads[i], "grads", i);
    check_state(exp_avgs[i], p, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (!masters.empty()) check_state(masters[i], p, "masters", i);
  }
}

}  // namespace adamw_args
}  // namespace shardkit
