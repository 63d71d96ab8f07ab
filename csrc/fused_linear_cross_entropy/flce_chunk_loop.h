// The chunk loop of shardkit_C::flce_chunked, shared by the CPU binding (fused_linear_cross_entropy.cpp) and
// the CUDA one (fused_linear_cross_entropy_cuda_binding.cpp); only the row pass differs between them.
//
// Per chunk of rows: logits = hidden[chunk] @ weight^T (+ bias) through at::mm (MKL / cuBLAS) in the input dtype,
// the row pass on them (loss per row, and the scaled dloss/dlogits written over the logits; 16-bit logits get
// fp32 math inside and the gradient rounded to nearest even, the rounding the naive path's backward applies
// before its matmuls too), then grad_hidden[chunk] = g @ weight and grad_weight += g^T @ hidden[chunk].
// Only one (chunk_rows, V) block of logits in the input dtype ever exists: 2 bytes a logit for 16-bit inputs
// (it was 8: the 16-bit matmul output, an fp32 copy and the 16-bit gradient; 705 MiB on the H200 at T=4096
// H=2048 V=128256 against Liger's 548), 4 for fp32.
// grad_weight: bf16 weights accumulate in a bf16 (V, H) tensor through addmm with beta = 1 (each chunk's product
// summed in fp32 inside the GEMM together with the running total, rounded once to bf16 per chunk: Liger-Kernel's
// scheme), so no fp32 (V, H) accumulator exists (4 B a weight: 1 GiB at V=128256, H=2048); the error is at most
// one bf16 rounding of the running sum per chunk (tests/kernels/test_fused_linear_cross_entropy.py states the
// bound). fp16 keeps the fp32 accumulator (fp16's range; see _saved_weight_dtype). Returns (loss fp32,
// grad_hidden in hidden's dtype, grad_weight bf16 or fp32, grad_bias fp32).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "shardkit/torch_utils.h"

namespace shardkit {

// Bound on the 16-bit temporary of one weight-gradient product: 32 MiB (8192 vocab rows at H=2048).
constexpr int64_t kGradWeightBlockBytes = int64_t{32} << 20;

// gw (V, H) fp32 += g^T @ hc with g (rows, V) and hc (rows, H) in 16 bits: the product runs as a 16-bit matmul
// (fp32 accumulation inside the GEMM), one block of vocab rows at a time into `tmp`, and add_into(dst, src)
// sums each block into the fp32 accumulator, so the sum across chunks is fp32 and no (V, H) 16-bit temporary
// ever exists.
template <typename AddInto>
void accumulate_weight_grad(at::Tensor& gw, const at::Tensor& g, const at::Tensor& hc, at::Tensor& tmp,
                            AddInto&& add_into) {
  const int64_t vocab = gw.size(0);
  const int64_t block = tmp.size(0);
  for (int64_t v0 = 0; v0 < vocab; v0 += block) {
    const int64_t rows = std::min(block, vocab - v0);
    at::Tensor part = tmp.narrow(0, 0, rows);
    at::mm_out(part, g.narrow(1, v0, rows).t(), hc);
    at::Tensor dst = gw.narrow(0, v0, rows);
    add_into(dst, part);
  }
}

// The gradient outputs of the chunk loop and the fp16 weight-gradient block temporary.
struct FlceGrads {
  at::Tensor& gh;
  at::Tensor& gw;
  at::Tensor& gb;
  at::Tensor& gw_tmp;
};

struct FlceNeed {
  bool hidden, weight, bias;
};

// Adds one chunk's logits gradient g (rows [s, s + g.size(0)), the input dtype) into grad_hidden's rows,
// grad_weight and grad_bias. 16-bit g feeds 16-bit matmuls, as the naive path's backward does (an fp32 matmul is
// ~15x slower on tensor cores, 2.7x on this CPU's bf16 path).
template <typename AddInto>
void fold_chunk(const at::Tensor& g, const at::Tensor& hc, const at::Tensor& weight, int64_t s, FlceGrads out,
                FlceNeed need, AddInto&& add_into) {
  if (need.hidden) {
    at::Tensor gh_rows = out.gh.slice(0, s, s + g.size(0));  // contiguous rows of a contiguous tensor
    at::mm_out(gh_rows, g, weight);
  }
  if (need.weight) {
    if (g.scalar_type() == out.gw.scalar_type()) {
      out.gw.addmm_(g.t(), hc);  // fp32, or bf16 folded into the bf16 grad_weight (one rounding per chunk)
    } else {
      accumulate_weight_grad(out.gw, g, hc, out.gw_tmp, add_into);  // fp16 into the fp32 accumulator
    }
  }
  if (need.bias) out.gb.add_(at::sum(g, {0}, false, at::kFloat));
}

// row_pass(z, s, e) runs on the (e - s, V) logits of rows [s, e) in the input dtype: it writes their losses into
// loss[s:e] (a float pointer it receives by capture) and, when the gradient is wanted, the gradient over z.
// add_into(dst, src) adds a contiguous 16-bit block to a contiguous fp32 one of the same shape (a device's own
// loop; see accumulate_weight_grad).
template <typename RowPass, typename AddInto>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_chunk_loop(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t chunk_rows,
    bool need_hidden, bool need_weight, bool need_bias, at::Tensor& loss, RowPass&& row_pass, AddInto&& add_into) {
  const int64_t n = hidden.size(0);
  const int64_t vocab = weight.size(0);
  const bool low = weight.scalar_type() != at::kFloat;
  const bool fold_bf16 = weight.scalar_type() == at::kBFloat16;
  const auto f32 = hidden.options().dtype(at::kFloat);
  const auto gw_options = fold_bf16 ? weight.options() : f32;
  at::Tensor gh = need_hidden ? empty_output_like(hidden) : at::empty({0}, hidden.options());
  at::Tensor gw = need_weight ? empty_output({vocab, weight.size(1)}, gw_options).zero_() : at::empty({0}, f32);
  at::Tensor gb = need_bias ? at::zeros({vocab}, f32) : at::empty({0}, f32);
  // One logits buffer, in the input dtype, reused by every chunk: each chunk is dead before the next one's
  // matmul writes over it, and a fresh (chunk, V) block per chunk would be a fresh mmap per chunk on CPU, whose
  // page faults cost as much as the row pass.
  at::Tensor z_buf = empty_output({std::min(n, chunk_rows), vocab}, weight.options());
  // fp16 weight-gradient products go through a temporary of at most kGradWeightBlockBytes (accumulate_weight_grad)
  const int64_t row_bytes = weight.element_size() * std::max<int64_t>(1, weight.size(1));
  const int64_t block_rows = std::max<int64_t>(1, kGradWeightBlockBytes / row_bytes);
  at::Tensor gw_tmp = low && !fold_bf16 && need_weight
                          ? at::empty({std::min(vocab, block_rows), weight.size(1)}, weight.options())
                          : at::Tensor();
  const at::Tensor wt = weight.t();
  const std::optional<at::Tensor> b =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(weight.scalar_type())) : std::nullopt;
  for (int64_t s = 0; s < n; s += chunk_rows) {
    const int64_t e = std::min(n, s + chunk_rows);
    const at::Tensor hc = hidden.slice(0, s, e);
    at::Tensor z = z_buf.narrow(0, 0, e - s);
    if (b.has_value()) {
      at::addmm_out(z, *b, hc, wt);
    } else {
      at::mm_out(z, hc, wt);
    }
    row_pass(z, s, e);
    if (need_hidden || need_weight || need_bias) {
      fold_chunk(z, hc, weight, s, {gh, gw, gb, gw_tmp}, {need_hidden, need_weight, need_bias}, add_into);
    }
  }
  // grad_weight (unless bf16) and grad_bias stay the fp32 accumulators: the caller decides what to keep them in
  // until the upstream gradient is applied (an fp16 grad_weight at the 1/n scale of a mean is mostly subnormal).
  return {loss, gh, gw, gb};
}

}  // namespace shardkit
