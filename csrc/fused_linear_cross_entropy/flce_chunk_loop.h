// The chunk loop of shardkit_C::flce_chunked, shared by the CPU binding (fused_linear_cross_entropy.cpp) and
// the CUDA one (fused_linear_cross_entropy_cuda_binding.cpp); only the row pass differs between them.
//
// Per chunk of rows: logits = hidden[chunk] @ weight^T (+ bias) through at::mm (MKL / cuBLAS), upcast to fp32,
// the row pass (loss per row, and the scaled dloss/dlogits written over the logits), then
// grad_hidden[chunk] = g @ weight and grad_weight += g^T @ hidden[chunk] (with 16-bit inputs both matmuls take g
// rounded to 16 bits, as the naive path's backward does). Only a (chunk_rows, V) block of logits ever exists.
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

// row_pass(z, s, e) runs on the fp32 (e - s, V) logits of rows [s, e): it writes their losses into
// loss[s:e] (a float pointer it receives by capture) and, when the gradient is wanted, the gradient over z.
// add_into(dst, src) adds a contiguous 16-bit block to a contiguous fp32 one of the same shape (a device's own
// loop; see accumulate_weight_grad).
template <typename RowPass, typename AddInto>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flce_chunk_loop(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t chunk_rows,
    bool need_hidden, bool need_weight, bool need_bias, at::Tensor& loss, RowPass&& row_pass, AddInto&& add_into) {
  const int64_t n = hidden.size(0);
  const int64_t vocab = weight.size(0);
  const bool write_grad = need_hidden || need_weight || need_bias;
  const bool low = weight.scalar_type() != at::kFloat;
  const bool fold_bf16 = weight.scalar_type() == at::kBFloat16;
  const auto f32 = hidden.options().dtype(at::kFloat);
  const auto gw_options = fold_bf16 ? weight.options() : f32;
  at::Tensor gh = need_hidden ? empty_output_like(hidden) : at::empty({0}, hidden.options());
  at::Tensor gw = need_weight ? empty_output({vocab, weight.size(1)}, gw_options).zero_() : at::empty({0}, f32);
  at::Tensor gb = need_bias ? at::zeros({vocab}, f32) : at::empty({0}, f32);
  // One logits buffer for every chunk (and a 16-bit one for 16-bit weights): a fresh (chunk, V) block per
  // chunk would be a fresh mmap per chunk on CPU, whose page faults cost as much as the row pass.
  const int64_t rows_max = std::min(n, chunk_rows);
  at::Tensor z_buf = empty_output({rows_max, vocab}, f32);
  at::Tensor z_low_buf = low ? empty_output({rows_max, vocab}, weight.options()) : at::Tensor();
  // 16-bit weight-gradient products go through a temporary of at most kGradWeightBlockBytes (see below)
  const int64_t row_bytes = weight.element_size() * std::max<int64_t>(1, weight.size(1));
  const int64_t block_rows = std::max<int64_t>(1, kGradWeightBlockBytes / row_bytes);
  at::Tensor gw_tmp = low && !fold_bf16 && need_weight ? at::empty({std::min(vocab, block_rows), weight.size(1)}, weight.options())
                                         : at::Tensor();
  const at::Tensor wt = weight.t();
  const std::optional<at::Tensor> b =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(weight.scalar_type())) : std::nullopt;
  for (int64_t s = 0; s < n; s += chunk_rows) {
    const int64_t e = std::min(n, s + chunk_rows);
    const at::Tensor hc = hidden.slice(0, s, e);
    at::Tensor z = z_buf.narrow(0, 0, e - s);
    at::Tensor z_mm = low ? z_low_buf.narrow(0, 0, e - s) : z;
    if (b.has_value()) {
      at::addmm_out(z_mm, *b, hc, wt);
    } else {
      at::mm_out(z_mm, hc, wt);
    }
    if (low) z.copy_(z_mm);  // softmax and gradient in fp32 for 16-bit inputs
    row_pass(z, s, e);
    if (!write_grad) continue;
    // 16-bit inputs: both gradient matmuls take the gradient rounded to the input dtype, as the naive path's
    // backward does, so they run at 16-bit matmul speed (an fp32 matmul is ~15x slower on tensor cores, 2.7x
    // on this CPU's bf16 path)
    if (low && (need_hidden || need_weight)) z_mm.copy_(z);
    if (need_hidden) {
      at::Tensor gh_rows = gh.slice(0, s, e);  // contiguous rows of a contiguous tensor: mm writes in place
      at::mm_out(gh_rows, z_mm, weight);
    }
    if (need_weight) {
      if (fold_bf16) {
        gw.addmm_(z_mm.t(), hc);
      } else if (low) {
        accumulate_weight_grad(gw, z_mm, hc, gw_tmp, add_into);
      } else {
        gw.addmm_(z.t(), hc);
      }
    }
    if (need_bias) gb.add_(z.sum(0));
  }
  // grad_weight (unless bf16) and grad_bias stay the fp32 accumulators: the caller decides what to keep them in
  // until the upstream gradient is applied (an fp16 grad_weight at the 1/n scale of a mean is mostly subnormal).
  return {loss, gh, gw, gb};
}

}  // namespace shardkit
