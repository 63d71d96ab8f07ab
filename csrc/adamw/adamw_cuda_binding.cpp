// CUDA torch glue for the fused AdamW step: registers shardkit_C::adamw_step_ for the CUDA key (CUDA torch only).
// The launcher takes one param dtype and one grad dtype per call, so the tensors are grouped by that pair
// (in practice one group) and each group is one multi-tensor launch sequence on the current stream.
#include <torch/library.h>

#include <map>
#include <utility>
#include <vector>

#include "adamw_args.h"
#include "adamw_cuda.h"
#include "shardkit/torch_cuda_utils.h"

namespace shardkit {
namespace {

struct Group {
  std::vector<void*> params;
  std::vector<float*> masters;
  std::vector<const void*> grads;
  std::vector<float*> exp_avgs;
  std::vector<float*> exp_avg_sqs;
  std::vector<int64_t> numels;
  std::vector<float> step_sizes;
  std::vector<float> bc2_sqrts;
};

void adamw_step_cuda_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList masters, at::ArrayRef<double> step_sizes,
                        at::ArrayRef<double> bc2_sqrts, double lr, double beta1, double beta2, double eps,
                        double weight_decay, bool maximize) {
  using adamw_args::kOp;
  adamw_args::check_all(params, grads, exp_avgs, exp_avg_sqs, masters, step_sizes, bc2_sqrts,
                        c10::DeviceType::CUDA);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  std::map<std::pair<DType, DType>, Group> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    Group& g = groups[{to_dtype(params[i], kOp), to_dtype(grads[i], kOp)}];
    g.params.push_back(params[i].data_ptr());
    g.masters.push_back(masters.empty() ? nullptr : masters[i].data_ptr<float>());
    g.grads.push_back(grads[i].data_ptr());
    g.exp_avgs.push_back(exp_avgs[i].data_ptr<float>());
    g.exp_avg_sqs.push_back(exp_avg_sqs[i].data_ptr<float>());
    g.numels.push_back(params[i].numel());
    g.step_sizes.push_back(static_cast<float>(step_sizes[i]));
    g.bc2_sqrts.push_back(static_cast<float>(bc2_sqrts[i]));
  }
  const cudaStream_t stream = current_stream(params[0]);
  for (auto& [dtypes, g] : groups) {
    check_cuda(adamw_step_cuda(g.params.data(), masters.empty() ? nullptr : g.masters.data(), g.grads.data(),
                               g.exp_avgs.data(), g.exp_avg_sqs.data(), g.numels.data(), g.step_sizes.data(),
                               g.bc2_sqrts.data(), static_cast<int>(g.params.size()), dtypes.first, dtypes.second,
                               static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                               static_cast<float>(eps), static_cast<float>(weight_decay), maximize, stream),
               kOp);
  }
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit_C, CUDA, m) { m.impl("adamw_step_", &shardkit::adamw_step_cuda_op); }
