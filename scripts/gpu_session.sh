#!/usr/bin/env bash
# What a session with a lent GPU runs first (device tool, one call): the CUDA and Triton kernel tests on the GPU,
# then the kernel benchmark, then the end-to-end training benchmark (benchmarks/gpu_e2e.py: a 1B Llama, plain HF vs
# HF+Liger (when installed) vs HF+shardkit kernels, eager and compiled, FP8 beside bf16). Logs go to $OUT (the
# device tool's return folder) or ./gpu_logs.
# Usage: bash scripts/gpu_session.sh [tests|bench|e2e|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
what="${1:-all}"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/shardkit_ext}" MAX_JOBS="${MAX_JOBS:-16}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
if [ "$what" = tests ] || [ "$what" = all ]; then
    # The CPU backends run in CI; here only the GPU ones (test ids carry the backend-device pair).
    timeout 420 python3 -m pytest tests/kernels -q -p no:cacheprovider -k "cuda" --timeout 400 --tb=short -rf \
        ${PYTEST_EXTRA:-} 2>&1 | tee "$out/kernel_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 500 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernel_bench.log" | tail -80
fi
if [ "$what" = e2e ] || [ "$what" = all ]; then
    # ~1 min per variant (8 variants; the compiled ones compile in their warmup steps)
    timeout 580 python3 benchmarks/gpu_e2e.py ${E2E_ARGS:-} 2>&1 | tee "$out/e2e_bench.log" | tail -20
fi
