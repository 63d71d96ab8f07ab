// Chunked log-probabilities CPU core, torch-free (used by linear_log_probs.cpp and
// csrc/tests/test_linear_log_probs.cpp): the two row passes over one chunk of logits z produced by a matmul, in
// fp32 or in 16 bits (bf16 / fp16 rows go through a per-thread fp32 scratch row).
//
// Per row, with y = softcap * tanh(z / softcap) (or y = z) and s = y * inv_temp:
//   forward:  lse = logsumexp(s), target = s[label] (0 when the label is not a column), m = sum(softmax(s) * s)
//   backward: dz = (grad_lp * (onehot(label) - p) - grad_ent * p * (s - m)) * inv_temp * dy/dz,  p = exp(s - lse),
//             dy/dz = 1 - (y / softcap)^2, written in place over the logits (16-bit: rounded to nearest even).
// A label outside [0, V) is "not among these columns" (a vocab-parallel head's slice, or an ignored row mapped
// there by the caller): no target, no one-hot term, never an error; label ranges are checked above the kernels.
// lse and m in backward are the row's statistics over the whole vocabulary (possibly several ranks' slices).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "shardkit/cpu_common.h"

namespace shardkit {

struct LlpRowParams {
  float softcap;   // <= 0: off
  float inv_temp;  // 1 / temperature
};

namespace llp_detail {

using vec::exp_nonpositive;
using vec::v8f;

// y <- softcap(y) * inv_temp over one fp32 row (skipped when both are the identity).
inline void scale_row(float* y, int64_t vocab, const LlpRowParams& p) {
  if (p.softcap > 0.f) {
    // NOTE: std::tanh keeps this sweep scalar; the polynomial tanh loses relative precision near 0 (as the fused
    // cross-entropy's row pass found), and cap * that error is ~3e-6 at Gemma 2's caps.
    const float cap = p.softcap, k = p.inv_temp;
    for (int64_t j = 0; j < vocab; ++j) y[j] = cap * std::tanh(y[j] / cap) * k;
  } else if (p.inv_temp != 1.f) {
    const float k = p.inv_temp;
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) y[j] *= k;
  }
}

// Forward statistics of one scaled fp32 row s. m is accumulated centred on the max (sum of e * (s - max), each
// term bounded by 1/e): summing e * s directly cancels at |s| ~ 10 and lost ~1e-5 of m at V = 4099 in fp32.
inline void row_stats(const float* s, int64_t vocab, int64_t label, float* lse, float* target, float* m) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < vocab; ++j) mx = s[j] > mx ? s[j] : mx;
  float se = 0.f;
#pragma omp simd reduction(+ : se)
  for (int64_t j = 0; j < vocab; ++j) se += exp_nonpositive(s[j] - mx);
  *lse = mx + std::log(se);
  *target = (label >= 0 && label < vocab) ? s[label] : 0.f;
  if (m != nullptr) {
    float w = 0.f;
#pragma omp simd reduction(+ : w)
    for (int64_t j = 0; j < vocab; ++j) w += exp_nonpositive(s[j] - mx) * (s[j] - mx);
    *m = mx + w / se;
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors without -mavx: only inlined, never an ABI
// s (scaled row) <- dz = p * (ge * (c - d) - gl) * inv_temp * (1 - (s * k)^2 if softcap), d = s - lse, p = exp(d),
// c = m - lse: s - m taken as two differences from lse, which p needs anyway (no cancellation at |s| ~ 10). The
// caller adds the label's one-hot term. k = temperature / softcap turns s back into y / softcap.
template <bool kSoftcap>
inline void write_grad(float* s, int64_t vocab, float lse, float c, float gl, float ge, float inv_temp, float k) {
  int64_t j = 0;
  for (; j + 8 <= vocab; j += 8) {
    v8f v;
    std::memcpy(&v, s + j, sizeof(v));
    const v8f d = v - lse;
    v8f g = exp_nonpositive(d) * (ge * (c - d) - gl) * inv_temp;
    if constexpr (kSoftcap) g = g * (1.f - (v * k) * (v * k));
    std::memcpy(s + j, &g, sizeof(g));
  }
  for (; j < vocab; ++j) {
    const float v = s[j], d = v - lse;
    float g = exp_nonpositive(d) * (ge * (c - d) - gl) * inv_temp;
    if constexpr (kSoftcap) g *= 1.f - (v * k) * (v * k);
    s[j] = g;
  }
}
#pragma GCC diagnostic pop

// Backward of one fp32 row of raw logits z, in place.
inline void row_grad(float* z, int64_t vocab, int64_t label, float gl, float ge, float lse, float m,
                     const LlpRowParams& p) {
  if (gl == 0.f && ge == 0.f) {  // a skipped row (ignored, or outside the loss): no gradient at all
    std::memset(z, 0, sizeof(float) * static_cast<size_t>(vocab));
    return;
  }
  scale_row(z, vocab, p);
  const bool here = label >= 0 && label < vocab;
  const float s_t = here ? z[label] : 0.f;
  const float c = ge != 0.f ? m - lse : 0.f;
  const float k = p.softcap > 0.f ? 1.f / (p.inv_temp * p.softcap) : 0.f;
  if (p.softcap > 0.f) {
    write_grad<true>(z, vocab, lse, c, gl, ge, p.inv_temp, k);
  } else {
    write_grad<false>(z, vocab, lse, c, gl, ge, p.inv_temp, k);
  }
  if (here) {
    const float t = s_t * k;
    z[label] += gl * p.inv_temp * (p.softcap > 0.f ? 1.f - t * t : 1.f);
  }
}

// The thread's fp32 view of row r: the row itself for fp32, else widened into buf.
template <typename T>
inline float* fp32_row(T* row, float* buf, int64_t vocab) {
  if constexpr (std::is_same_v<T, float>) {
    (void)buf;
    (void)vocab;
    return row;
  } else {
    for (int64_t j = 0; j < vocab; ++j) buf[j] = to_float(row[j]);
    return buf;
  }
}

}  // namespace llp_detail

// Forward over a chunk of rows (row stride ld elements of T: float, bf16 or fp16), OpenMP over rows. The logits
// are scratch afterwards (fp32 rows are scaled in place). m may be nullptr (no entropy wanted).
template <typename T>
void llp_rows_forward_cpu(T* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* labels,
                          const LlpRowParams& p, float* lse, float* target, float* m) {
#pragma omp parallel
  {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(vocab));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* s = llp_detail::fp32_row(logits + r * ld, buf.data(), vocab);
      llp_detail::scale_row(s, vocab, p);
      llp_detail::row_stats(s, vocab, labels[r], lse + r, target + r, m ? m + r : nullptr);
    }
  }
}

// Backward over a chunk of rows: the logits are overwritten with their gradient. grad_ent and m may be nullptr
// (no entropy term).
template <typename T>
void llp_rows_backward_cpu(T* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* labels,
                           const float* grad_lp, const float* grad_ent, const float* lse, const float* m,
                           const LlpRowParams& p) {
#pragma omp parallel
  {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(vocab));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* row = logits + r * ld;
      float* z = llp_detail::fp32_row(row, buf.data(), vocab);
      const float ge = grad_ent ? grad_ent[r] : 0.f;
      llp_detail::row_grad(z, vocab, labels[r], grad_lp[r], ge, lse[r], grad_ent ? m[r] : 0.f, p);
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < vocab; ++j) row[j] = from_float<T>(z[j]);
      }
    }
  }
}

}  // namespace shardkit
