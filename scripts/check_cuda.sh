#!/usr/bin/env bash
# Compile-check the CUDA code where no GPU (or no CUDA build of torch) exists:
#   1. every csrc/**/*.cu with plain nvcc (no torch headers) for sm_80 and sm_90, about 2 s per file and arch;
#   2. every csrc/*/*_cuda_binding.cpp (the torch glue of the CUDA kernels) syntax-checked with nvcc's host
#      compiler against this torch's headers, about 7 s a file. A CPU build of torch ships the c10/cuda and
#      ATen/cuda headers but not the generated c10/cuda/impl/cuda_cmake_macros.h, which only defines an export
#      macro: C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips it. Compiling the bindings for real and linking them needs a
#      CUDA build of torch: scripts/check_cuda_link.py does that (no GPU needed), run with such a torch's Python.
# Usage: scripts/check_cuda.sh   (NVCC=/path/to/nvcc and PYTHON=/path/to/python to override)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
PYTHON="${PYTHON:-python}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda.sh: nvcc not found ($NVCC); install the CUDA toolkit or set NVCC" >&2
  exit 2
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mapfile -t kernels < <(find csrc -name '*.cu' | sort)
mapfile -t bindings < <(find csrc -name '*_cuda_binding.cpp' | sort)
if [ "${#kernels[@]}" -eq 0 ]; then
  echo "check_cuda.sh: no .cu files under csrc/" >&2
  exit 1
fi
# Each file compiles on its own, so they run side by side, one per core (a file's log is printed whole, in order).
jobs="${JOBS:-$(nproc)}"
compile_kernel() {
  local f="$1" log="$2" dir
  dir="$(dirname "$f")"
  if "$NVCC" -std=c++17 -O3 -Icsrc/include -I"$dir" \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -c "$f" -o "$out/$(basename "$f").o" >"$log" 2>&1; then
    echo "ok     $f" >>"$log"
  else
    echo "FAILED $f" >>"$log"
    return 1
  fi
}
if ! torch_includes="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths
print(" ".join("-I" + p for p in include_paths()))' 2>/dev/null)"; then
  echo "check_cuda.sh: torch is not importable with $PYTHON; set PYTHON to check the *_cuda_binding.cpp files" >&2
  exit 2
fi
compile_binding() {
  local f="$1" log="$2" dir
  dir="$(dirname "$f")"
  # shellcheck disable=SC2086  # torch_includes is a list of -I flags
  if "$NVCC" -x c++ -std=c++20 -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE $torch_includes -Icsrc/include -I"$dir" \
      -Xcompiler -fsyntax-only -c "$f" -o "$out/$(basename "$f").o" >"$log" 2>&1; then
    echo "ok     $f (syntax, against torch's headers)" >>"$log"
  else
    echo "FAILED $f" >>"$log"
    return 1
  fi
}
failed=0
pids=()
files=()
for f in "${kernels[@]}" "${bindings[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  case "$f" in *.cu) compile_kernel "$f" "$out/${#pids[@]}.log" & ;; *) compile_binding "$f" "$out/${#pids[@]}.log" & ;; esac
  pids+=("$!")
  files+=("$f")
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" 2>/dev/null || true  # may already be reaped by `wait -n`: the log says how it ended
  log="$out/$i.log"
  if grep -q '^ok ' "$log"; then cat "$log"; else cat "$log" >&2; failed=1; fi
done
exit "$failed"
