// Fused linear cross-entropy CPU core, torch-free (used by fused_linear_cross_entropy.cpp and
// csrc/tests/test_flce.cpp): the row-wise pass over one chunk of logits produced by a matmul, in fp32 or in
// 16 bits (bf16 / fp16: each row goes through a per-thread fp32 scratch row, the gradient is written back over
// the 16-bit logits rounded to nearest even, so no fp32 copy of the chunk exists).
//
// For each row with label t (y = softcap * tanh(z / softcap) when softcap > 0, else y = z):
//   loss = lse(y) - (1 - eps) * y_t - eps * mean(y)                  (eps = label_smoothing, torch's definition)
//   grad = scale * (softmax(y) - (1 - eps) * onehot(t) - eps / V) * dy/dz,   dy/dz = 1 - (y / softcap)^2
// written in place over the logits. Rows whose label is ignore_index get loss 0 and grad 0.
// Three sweeps over one row (max, sum-exp, write): a 128 Ki-vocab row is 512 KiB, so sweeps 2 and 3
// mostly hit L2 and the chunk costs about one DRAM read and one write of its logits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "shardkit/cpu_common.h"

namespace shardkit {

struct FlceRowParams {
  int64_t ignore_index;
  float label_smoothing;
  float softcap;    // <= 0: off
  bool write_grad;  // false: loss only (reduction="none" forward, eval)
};

namespace flce_detail {

// exp for x <= 0 (arguments are y - max), scalar and 8-wide: shared with SwiGLU in shardkit/cpu_common.h.
// NOTE: GCC (12, -O3, no -ffast-math) leaves loops that *store* the clamped exp scalar ("control flow
// in loop"), although it vectorises the summing loop; so the gradient sweeps use the 8-wide generic-vector
// form and a scalar tail.
using vec::exp_nonpositive;
using vec::v8f;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors without -mavx: only inlined, never an ABI
// grad_j = scale * (exp(y_j - lse) - off) * (1 - (y_j * inv_cap)^2 if softcap); the caller subtracts the
// label's (1 - eps) term.
template <bool kSoftcap>
inline void write_grad(float* y, int64_t vocab, float lse, float off, float scale, float inv_cap) {
  int64_t j = 0;
  for (; j + 8 <= vocab; j += 8) {
    v8f v;
    std::memcpy(&v, y + j, sizeof(v));
    v8f g = (exp_nonpositive(v - lse) - off) * scale;
    if constexpr (kSoftcap) g = g * (1.f - (v * inv_cap) * (v * inv_cap));
    std::memcpy(y + j, &g, sizeof(g));
  }
  for (; j < vocab; ++j) {
    float g = scale * (exp_nonpositive(y[j] - lse) - off);
    if constexpr (kSoftcap) g *= 1.f - (y[j] * inv_cap) * (y[j] * inv_cap);
    y[j] = g;
  }
}
#pragma GCC diagnostic pop

}  // namespace flce_detail

// One row, in place. Returns false when the label is out of range (neither ignore_index nor in [0, V)).
inline bool flce_row(float* y, int64_t vocab, int64_t label, float scale, float* loss, const FlceRowParams& p) {
  using flce_detail::exp_nonpositive;
  if (label == p.ignore_index) {
    *loss = 0.f;
    if (p.write_grad) std::memset(y, 0, sizeof(float) * static_cast<size_t>(vocab));
    return true;
  }
  if (label < 0 || label >= vocab) return false;
  const float cap = p.softcap;
  float mx = -INFINITY;
  float sum_y = 0.f;
  if (cap > 0.f) {
    // NOTE: std::tanh keeps this sweep scalar; it is the price of full fp32 accuracy for Gemma-2 caps
    // (the polynomial tanh loses relative precision near 0, and cap * error reaches ~3e-6 at cap = 30).
    for (int64_t j = 0; j < vocab; ++j) {
      const float v = cap * std::tanh(y[j] / cap);
      y[j] = v;
      mx = v > mx ? v : mx;
      sum_y += v;
    }
  } else {
#pragma omp simd reduction(max : mx) reduction(+ : sum_y)
    for (int64_t j = 0; j < vocab; ++j) {
      mx = y[j] > mx ? y[j] : mx;
      sum_y += y[j];
    }
  }
  float se = 0.f;
#pragma omp simd reduction(+ : se)
  for (int64_t j = 0; j < vocab; ++j) se += exp_nonpositive(y[j] - mx);
  const float lse = mx + std::log(se);
  const float eps = p.label_smoothing;
  const float yt = y[label];
  *loss = lse - (1.f - eps) * yt - eps * (sum_y / static_cast<float>(vocab));
  if (!p.write_grad) return true;
  const float off = eps / static_cast<float>(vocab);
  const float keep = 1.f - eps;
  if (cap > 0.f) {
    flce_detail::write_grad<true>(y, vocab, lse, off, scale, 1.f / cap);
    const float t = yt / cap;
    y[label] -= scale * keep * (1.f - t * t);
  } else {
    flce_detail::write_grad<false>(y, vocab, lse, off, scale, 0.f);
    y[label] -= scale * keep;
  }
  return true;
}

namespace flce_detail {

// One 16-bit row through the fp32 row pass: widened into `buf` (vocab floats, the calling thread's), run in
// place there, and the gradient rounded back over the row. The scratch row stays in L2 (512 KiB at V=128256),
// so the 16-bit row is read once and written once from DRAM, as the fp32 row is.
template <typename T>
bool flce_row_16bit(T* row, float* buf, int64_t vocab, int64_t label, float scale, float* loss,
                    const FlceRowParams& p) {
  if (label == p.ignore_index) {
    *loss = 0.f;
    if (p.write_grad) std::memset(static_cast<void*>(row), 0, sizeof(T) * static_cast<size_t>(vocab));
    return true;
  }
  if (label < 0 || label >= vocab) return false;
  for (int64_t j = 0; j < vocab; ++j) buf[j] = to_float(row[j]);
  flce_row(buf, vocab, label, scale, loss, p);
  if (p.write_grad)
    for (int64_t j = 0; j < vocab; ++j) row[j] = from_float<T>(buf[j]);
  return true;
}

}  // namespace flce_detail

// A chunk of rows (row stride ld elements of T: float, bf16 or fp16), OpenMP over rows. row_scale may be
// nullptr (scale 1). Returns the index of the first row with an out-of-range label, or -1.
template <typename T>
int64_t flce_rows_cpu(T* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* labels,
                      const float* row_scale, float* loss, const FlceRowParams& p) {
  int64_t bad = -1;
#pragma omp parallel
  {
    // 16-bit rows: one fp32 scratch row per thread, not per row or per chunk
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(vocab));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = row_scale ? row_scale[r] : 1.f;
      bool ok;
      if constexpr (std::is_same_v<T, float>) {
        ok = flce_row(logits + r * ld, vocab, labels[r], scale, loss + r, p);
      } else {
        ok = flce_detail::flce_row_16bit(logits + r * ld, buf.data(), vocab, labels[r], scale, loss + r, p);
      }
      if (!ok) {
#pragma omp critical
        bad = (bad < 0 || r < bad) ? r : bad;
      }
    }
  }
  return bad;
}

// dst[i] += src[i] in fp32 for a 16-bit src: one block of the weight-gradient product summed into the fp32
// accumulator. Measured on the 2-core dev machine for an (8192, 2048) bf16 block: torch's mixed-dtype add_
// 42 ms, this loop about a memory pass (a copy to fp32 plus an fp32 add_ took 16 ms).
template <typename T>
void flce_add_into_f32(float* dst, const T* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += to_float(src[i]);
}

}  // namespace shardkit
