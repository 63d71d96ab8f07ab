// AdamW CPU core, torch-free (used by adamw.cpp and csrc/tests/test_adamw.cpp).
//
// One fused pass per tensor: read p (or its fp32 master), g, m, v; write p, m, v (and the rounded
// low-precision param when a master copy exists). fp32 params move 4 streams in + 3 out = 28 bytes
// per parameter, which makes the update memory-bound: the goal is to stream at bandwidth, so the
// work is cut into 64 Ki-element chunks spread over OpenMP threads, and each element is read and
// written once, in one vectorised loop (the square root vectorises because the build passes
// -fno-math-errno; with errno semantics GCC keeps a scalar sqrtf call and the loop runs ~20% slower).
//
// Same operation order as torch.optim.AdamW (single-tensor path), so fp32 results agree to rounding:
//   p = p * (1 - lr * wd)
//   m = m + (1 - b1) * (g - m)                  (torch: exp_avg.lerp_(g, 1 - b1))
//   v = v * b2 + (1 - b2) * g * g
//   p = p - step_size * m / (sqrt(v) / sqrt(bc2) + eps),   step_size = lr / bc1
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/cpu_common.h"

namespace shardkit {

// Scalars of one step, precomputed in double by the caller (as torch does in Python) and passed as fp32.
struct AdamWHyper {
  float decay;      // 1 - lr * weight_decay
  float beta1;
  float beta2;
  float eps;
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  bool maximize;
};

namespace adamw_detail {

constexpr int64_t kBlock = 256;          // 1 KiB fp32 scratch for a 16-bit param without master: stays in L1
constexpr int64_t kChunk = 64 * 1024;    // per-thread unit of work: 64 Ki params = 1.75 MiB of traffic

// One block: `pf` is the fp32 param (the master copy, the fp32 param itself, or a scratch copy).
template <typename G>
inline void block_update(float* __restrict pf, const G* __restrict g, float* __restrict m, float* __restrict v,
                         int64_t n, const AdamWHyper& h) {
  const float sign = h.maximize ? -1.f : 1.f;
  const float w1 = 1.f - h.beta1;
  const float w2 = 1.f - h.beta2;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = sign * to_float(g[i]);
    const float mi = m[i] + w1 * (gi - m[i]);
    const float vi = v[i] * h.beta2 + w2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    pf[i] = pf[i] * h.decay - h.step_size * (mi / (__builtin_sqrtf(vi) / h.bc2_sqrt + h.eps));
  }
}

}  // namespace adamw_detail

// AdamW step over elements [begin, end) of one tensor, serial (the caller parallelises over chunks).
//   param:  P storage (float, bf16 or fp16), updated in place.
//   master: fp32 master copy or nullptr. With a master the update runs on it and param receives the
//           rounded result; without one a 16-bit param is widened per block, updated in fp32 and rounded.
//   grad:   G storage (float, bf16 or fp16); exp_avg / exp_avg_sq: fp32.
template <typename P, typename G>
void adamw_step_range(P* param, float* master, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t begin,
                      int64_t end, const AdamWHyper& h) {
  using namespace adamw_detail;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t len = end - b < kBlock ? end - b : kBlock;
    float scratch[kBlock];
    float* pf;
    if (master != nullptr) {
      pf = master + b;
    } else if constexpr (sizeof(P) == sizeof(float)) {
      pf = reinterpret_cast<float*>(param) + b;
    } else {
      pf = scratch;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) scratch[i] = to_float(param[b + i]);
    }
    block_update(pf, grad + b, exp_avg + b, exp_avg_sq + b, len, h);
    if (master != nullptr || sizeof(P) != sizeof(float)) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) param[b + i] = from_float<P>(pf[i]);
    }
  }
}

// AdamW step over one whole tensor of n elements, OpenMP over 64 Ki-element chunks.
template <typename P, typename G>
void adamw_step_cpu(P* param, float* master, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamWHyper& h) {
  using adamw_detail::kChunk;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    adamw_step_range(param, master, grad, exp_avg, exp_avg_sq, c * kChunk, end, h);
  }
}

// Scalar reference of the same step (tests): plain loop, double-free, same formula.
template <typename P, typename G>
void adamw_step_scalar(P* param, float* master, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                       const AdamWHyper& h) {
  for (int64_t i = 0; i < n; ++i) {
    float p = master ? master[i] : to_float(param[i]);
    const float g = (h.maximize ? -1.f : 1.f) * to_float(grad[i]);
    p = p * h.decay;
    exp_avg[i] = exp_avg[i] + (1.f - h.beta1) * (g - exp_avg[i]);
    exp_avg_sq[i] = exp_avg_sq[i] * h.beta2 + (1.f - h.beta2) * g * g;
    p = p - h.step_size * (exp_avg[i] / (std::sqrt(exp_avg_sq[i]) / h.bc2_sqrt + h.eps));
    if (master) master[i] = p;
    param[i] = from_float<P>(p);
  }
}

}  // namespace shardkit
