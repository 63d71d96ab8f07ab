// Gated-linear-unit CPU cores, torch-free (used by swiglu.cpp and csrc/tests/test_swiglu.cpp):
//   SwiGLU (Llama):  y = silu(g) * u          = g * sigmoid(g) * u
//   GeGLU (Gemma):   y = gelu_tanh(g) * u     = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) * u
// Both are y = g * sigmoid(a(g)) * u (0.5 (1 + tanh z) = sigmoid(2 z)), so one loop serves both:
//   dg = dy * u * (s + g s (1 - s) a'(g)),  du = dy * g * s   (s recomputed: nothing but g, u saved)
// The backward may write dg over g and du over u (in-place form): every element is read before it is written
// and no other element reads it, which is what lets the MLP's backward allocate nothing of the
// (tokens, intermediate) size (Liger's memory).
// Memory-bound (fp32: 12 B/elem forward, 20 B/elem backward), so the loops must run at vector width: the
// sigmoid uses the branch-free 8-wide exp of cpu_common.h (std::exp kept them scalar: 916 ms fwd+bwd at
// (4096, 11008) fp32, slower than inductor's 529 ms).
#pragma once

#include <cstdint>

#include "shardkit/cpu_common.h"

namespace shardkit {

// 16 Ki elements = 64 KiB of fp32 per input per chunk: big enough to amortise the OpenMP schedule, small
// enough that 2 threads split a (4, 128, 11008) activation into ~350 chunks each. A multiple of 8 lanes.
constexpr int64_t kSwigluChunk = 16384;

enum class GluAct { kSilu, kGeluTanh };

// gelu_tanh's sigmoid argument: 2 sqrt(2/pi) (g + 0.044715 g^3).
constexpr float kGeluTwoSqrt2OverPi = 1.5957691216057308f;
constexpr float kGeluCubic = 0.044715f;

namespace swiglu_detail {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors without -mavx: only inlined, never an ABI
// a(g) and a'(g) of y = g * sigmoid(a(g)) * u, for scalars and 8-wide vectors alike.
template <GluAct A, typename V>
__attribute__((always_inline)) inline V act_arg(V g) {
  if constexpr (A == GluAct::kSilu) {
    return g;
  } else {
    return kGeluTwoSqrt2OverPi * (g + kGeluCubic * g * g * g);
  }
}

template <GluAct A, typename V>
__attribute__((always_inline)) inline V act_darg(V g) {
  if constexpr (A == GluAct::kSilu) {
    return g - g + 1.f;
  } else {
    return kGeluTwoSqrt2OverPi * (1.f + 3.f * kGeluCubic * g * g);
  }
}

template <GluAct A, typename T>
inline void fwd_range(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const vec::v8f gv = vec::load8(g + i);
    vec::store8(y + i, gv * vec::sigmoid(act_arg<A>(gv)) * vec::load8(u + i));
  }
  for (; i < end; ++i) {
    const float gv = to_float(g[i]);
    y[i] = from_float<T>(gv * vec::sigmoid(act_arg<A>(gv)) * to_float(u[i]));
  }
}

// dg may equal g and du may equal u (in place): each index is loaded in full before it is stored.
template <GluAct A, typename T>
inline void bwd_range(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const vec::v8f gv = vec::load8(g + i);
    const vec::v8f uv = vec::load8(u + i);
    const vec::v8f d = vec::load8(dy + i);
    const vec::v8f sig = vec::sigmoid(act_arg<A>(gv));
    const vec::v8f ds = d * sig;
    const vec::v8f dgv = d * uv * (sig + gv * sig * (1.f - sig) * act_darg<A>(gv));
    vec::store8(dg + i, dgv);
    vec::store8(du + i, ds * gv);
  }
  for (; i < end; ++i) {
    const float gv = to_float(g[i]);
    const float uv = to_float(u[i]);
    const float d = to_float(dy[i]);
    const float sig = vec::sigmoid(act_arg<A>(gv));
    dg[i] = from_float<T>(d * uv * (sig + gv * sig * (1.f - sig) * act_darg<A>(gv)));
    du[i] = from_float<T>(d * sig * gv);
  }
}
#pragma GCC diagnostic pop

}  // namespace swiglu_detail

template <GluAct A, typename T>
void glu_fwd_cpu(const T* g, const T* u, T* y, int64_t numel) {
  const int64_t chunks = (numel + kSwigluChunk - 1) / kSwigluChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = (c + 1) * kSwigluChunk < numel ? (c + 1) * kSwigluChunk : numel;
    swiglu_detail::fwd_range<A>(g, u, y, c * kSwigluChunk, end);
  }
}

// dg == g and du == u is allowed (the in-place backward).
template <GluAct A, typename T>
void glu_bwd_cpu(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t numel) {
  const int64_t chunks = (numel + kSwigluChunk - 1) / kSwigluChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = (c + 1) * kSwigluChunk < numel ? (c + 1) * kSwigluChunk : numel;
    swiglu_detail::bwd_range<A>(dy, g, u, dg, du, c * kSwigluChunk, end);
  }
}

template <typename T>
void swiglu_fwd_cpu(const T* g, const T* u, T* y, int64_t numel) {
  glu_fwd_cpu<GluAct::kSilu>(g, u, y, numel);
}

template <typename T>
void swiglu_bwd_cpu(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t numel) {
  glu_bwd_cpu<GluAct::kSilu>(dy, g, u, dg, du, numel);
}

}  // namespace shardkit
