// Helpers for the torch bindings only (needs torch headers; the CPU cores and .cu files do not).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "shardkit/cpu_common.h"
#include "shardkit/torch_checks.h"  // check_same

namespace shardkit {

static_assert(sizeof(bf16) == sizeof(c10::BFloat16), "bf16 must be layout-compatible with c10::BFloat16");
static_assert(sizeof(fp16) == sizeof(c10::Half), "fp16 must be layout-compatible with c10::Half");

// Calls fn(T{}) with T = float | bf16 | fp16 for the tensor's dtype; other dtypes raise naming the op.
template <typename Fn>
void dispatch_float_types(const at::Tensor& t, const char* op, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kBFloat16:
      fn(bf16{});
      break;
    case at::kHalf:
      fn(fp16{});
      break;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), "; use float32, bfloat16 or float16");
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Transparent huge pages for large fresh outputs. A fresh CPU tensor of more than a few MiB is a new mmap
// (glibc), and the first write to each 4 KiB page traps into the kernel: filling a fresh 180 MiB tensor took
// 70 ms that way on the 2-core dev machine, against 16 ms with the range advised to 2 MiB pages (see
// benchmarks/RESULTS.md). For these memory-bound ops that is most of the run time, so outputs of 4 MiB or more
// are advised (MADV_HUGEPAGE, the 2 MiB-aligned interior only) before the kernel writes them; torch does the
// same for every allocation under THP_MEM_ALLOC_ENABLE=1. No effect where THP is "never", or with
// SHARDKIT_HUGE_PAGES=0.
inline bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SHARDKIT_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const size_t nbytes = t.storage().nbytes();
  if (!t.device().is_cpu() || nbytes < 2 * kHuge || !huge_pages_enabled()) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.storage().data());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + nbytes) & ~(kHuge - 1);
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only
#else
  (void)t;
#endif
}

// at::empty / at::empty_like for an op's output, advised to huge pages when large (see above).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  advise_huge_pages(t);
  return t;
}

inline at::Tensor empty_output_like(const at::Tensor& like) {
  at::Tensor t = at::empty_like(like, at::MemoryFormat::Contiguous);
  advise_huge_pages(t);
  return t;
}

}  // namespace shardkit

