#!/usr/bin/env bash
# What a session with a lent GPU runs (device tool, one call): the CUDA and Triton kernel tests on the GPU, the
# self-checking GPU scripts (scripts/gpu_checks/*.py: CUDA OOM snapshot, ...), the kernel benchmark, then the
# end-to-end training benchmark (benchmarks/gpu_e2e.py: a 1B Llama, plain HF vs HF+Liger vs HF+shardkit kernels,
# eager then compiled, FP8 beside bf16). Logs go to $OUT (the device tool's return folder) or ./gpu_logs.
# A lend is short (15 minutes of device time, 10 per command), so every phase runs under one deadline
# (GPU_BUDGET_S seconds from the start, default 560) and is cut off rather than letting the call run over.
# Wheels a lend carries (liger-kernel, torchao) are installed from .whl/ when that folder exists.
# Usage: bash scripts/gpu_session.sh [all | "tests e2e" | any of tests, checks, adamw, bench, e2e, cp] (bench includes
# adamw: the AdamW rows of benchmarks/kernels.py); GPU_TESTS_K narrows
# the kernel tests (a pytest -k expression, "cuda" by default).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
what="${1:-all}"
start=$(date +%s)
budget="${GPU_BUDGET_S:-560}"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/shardkit_ext}" MAX_JOBS="${MAX_JOBS:-16}"

# seconds for the next phase: its own cap, or what is left of the budget less a reserve for the later phases
# (reserves are written for the default 560 s and scale with GPU_BUDGET_S)
left() { local cap=$1 reserve=$(( ${2:-0} * budget / 560 )) rest; rest=$(( budget - ($(date +%s) - start) - reserve )); \
         (( rest < cap )) && cap=$rest; (( cap < 5 )) && cap=5; echo "$cap"; }
phase() { echo "== $1 at +$(( $(date +%s) - start ))s" | tee -a "$out/phases.txt"; }
wants() { [ "$what" = all ] || [[ " $what " == *" $1 "* ]]; }

phase setup
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3

if wants tests; then
    phase tests  # the CPU backends run in CI; here only the GPU ones (test ids carry the backend-device pair)
    t=$(left 150 380)
    timeout "$t" python3 -m pytest tests/kernels tests/unit/test_cp_attention.py -q -p no:cacheprovider -k "${GPU_TESTS_K:-cuda}" --timeout "$t" --tb=short -rf \
        ${PYTEST_EXTRA:-} 2>&1 | tee "$out/kernel_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
fi
if wants checks; then
    phase checks
    for check in scripts/gpu_checks/*.py; do
        [ -e "$check" ] || continue
        timeout "$(left 60 380)" python3 "$check" 2>&1 | tee -a "$out/gpu_checks.log" | grep -E "PASS|FAIL|Error" | tail -10
    done
fi
if wants bench || wants adamw; then
    phase adamw  # issue 28 item 3: the multi-tensor Triton launch vs torch's fused/foreach, 110M in 111 tensors
    timeout "$(left 60 320)" python3 benchmarks/kernels.py --only adamw 2>&1 | tee "$out/adamw_bench.log" \
        | grep -vE "^\[|^#" | tail -16
fi
if wants bench; then
    phase bench
    timeout "$(left 120 260)" python3 benchmarks/kernels.py --only ops 2>&1 | tee "$out/kernel_bench.log" \
        | grep -vE "^\[|^#" | tail -70
    timeout "$(left 35 225)" python3 benchmarks/kernels.py --only flce --flce-dtype bfloat16 2>&1 \
        | tee "$out/flce_bf16.log" | tail -12
    # launch-setting sweep of the Triton rms_norm and multi-tensor AdamW (issue 28 item 3; ~60 s, its own deadline)
    timeout "$(left 65 160)" python3 benchmarks/gpu_tune.py 2>&1 | tee "$out/gpu_tune.log" | tail -30
fi
if wants e2e; then
    phase e2e  # eager variants first (~15 s each), then compiled (~1 min each) while the budget lasts
    timeout "$(left 580 75)" python3 benchmarks/gpu_e2e.py ${E2E_ARGS:-} 2>&1 | tee "$out/e2e_bench.log" | tail -14
fi
if wants cp; then
    phase cp  # issue 26: ContextParallel(ring) vs torch's context_parallel + FSDP2, step time ratio (estimated ~40 s
    # on 1 GPU, not yet measured; cp=2 and up need a GPU per rank and are printed as skipped on a one-GPU lend)
    t=$(left 65 0)
    if (( t < 30 )); then
        echo "cp phase skipped: only ${t} s of the budget left" | tee "$out/cp_vs_torch.log"
    else
        timeout "$t" python3 benchmarks/context_parallel.py --vs-torch --cps 1 2 --timeout "$(( t - 5 ))" 2>&1 \
            | tee "$out/cp_vs_torch.log" | grep -vE "^\[" | tail -12
    fi
fi
phase done
