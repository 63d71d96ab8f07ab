// Torch binding + CPU kernel of the fused AdamW step in the shardkit_C op namespace (one source of the
// one extension). One call updates a whole list of tensors: the work is cut into 64 Ki-element chunks
// across all tensors and spread over one OpenMP region, so small tensors (biases, norms) do not each pay
// a parallel-region start (~2 us) and large ones are split evenly between threads.
#include <torch/library.h>

#include <utility>
#include <vector>

#include "adamw_args.h"
#include "adamw_cpu.h"
#include "shardkit/torch_utils.h"

namespace shardkit {
namespace {

using adamw_args::kOp;

template <typename P, typename G>
void run_range(const at::Tensor& p, float* master, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               int64_t begin, int64_t end, const AdamWHyper& h) {
  adamw_step_range<P, G>(ptr<P>(p), master, ptr<G>(g), m.data_ptr<float>(), v.data_ptr<float>(), begin, end, h);
}

template <typename P>
void run_range_grad(const at::Tensor& p, float* master, const at::Tensor& g, const at::Tensor& m,
                    const at::Tensor& v, int64_t begin, int64_t end, const AdamWHyper& h) {
  dispatch_float_types(g, kOp, [&](auto gtag) { run_range<P, decltype(gtag)>(p, master, g, m, v, begin, end, h); });
}

void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList masters, at::ArrayRef<double> step_sizes, at::ArrayRef<double> bc2_sqrts, double lr,
                 double beta1, double beta2, double eps, double weight_decay, bool maximize) {
  adamw_args::check_all(params, grads, exp_avgs, exp_avg_sqs, masters, step_sizes, bc2_sqrts, c10::DeviceType::CPU);
  const size_t n = params.size();
  std::vector<std::pair<size_t, int64_t>> tasks;  // (tensor, chunk start)
  for (size_t i = 0; i < n; ++i) {
    for (int64_t s = 0; s < params[i].numel(); s += adamw_detail::kChunk) tasks.emplace_back(i, s);
  }
  std::vector<AdamWHyper> hyper(n);
  for (size_t i = 0; i < n; ++i) {
    hyper[i] = AdamWHyper{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(beta1),
                          static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(step_sizes[i]),
                          static_cast<float>(bc2_sqrts[i]), maximize};
  }
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(static) if (ntasks > 1)
  for (int64_t t = 0; t < ntasks; ++t) {
    const size_t i = tasks[t].first;
    const int64_t begin = tasks[t].second;
    const at::Tensor& p = params[i];
    const int64_t end = std::min<int64_t>(begin + adamw_detail::kChunk, p.numel());
    float* master = masters.empty() ? nullptr : masters[i].data_ptr<float>();
    dispatch_float_types(p, kOp, [&](auto ptag) {
      run_range_grad<decltype(ptag)>(p, master, grads[i], exp_avgs[i], exp_avg_sqs[i], begin, end, hyper[i]);
    });
  }
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_FRAGMENT(shardkit_C, m) {
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] masters, float[] step_sizes, float[] bc2_sqrts, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool maximize) -> ()");
}

TORCH_LIBRARY_IMPL(shardkit_C, CPU, m) { m.impl("adamw_step_", &shardkit::adamw_step_); }
