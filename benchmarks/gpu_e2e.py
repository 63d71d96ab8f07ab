"""End-to-end training step of a ~1B Llama in bf16 on one GPU: plain HF, HF + Liger-Kernel, HF + shardkit's
kernels, each eager and then under torch.compile, and shardkit's kernels with FP8 linears beside them.

Run (a GPU lend runs it through ``scripts/gpu_session.sh e2e``): ``python benchmarks/gpu_e2e.py``.
Smoke run on CPU at tiny shapes (checks every variant builds, steps and reports; figures meaningless):
``python benchmarks/gpu_e2e.py --smoke``.

Model: Llama 3.2 1B's shape (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads, vocab 128256: 1.24B
parameters), random weights built locally, bf16 parameters, fused AdamW (torch's), SDPA attention. Steps of
``--batch`` x ``--seq`` tokens (4 x 4096). Per variant: median step time after warmup -> tokens/s; MFU =
(6 N + 12 L d T) FLOPs per token x tokens/s / the GPU's dense bf16 peak (``--peak-tflops``, default by name:
H100/H200 989); peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps. Variants run one after
the other in this process (memory freed and dynamo reset in between), so they share the machine's state.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import fmt_bytes, machine_description, print_table, sync  # noqa: E402

_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, tie_word_embeddings=True)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=128)
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def _peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)


def _build(cfg: dict, device: torch.device, attn: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**cfg)
    config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return model.train()


def _liger(model: torch.nn.Module) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel not installed"
    if next(model.parameters()).device.type != "cuda":
        return "Liger-Kernel's Triton kernels need a GPU"
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return None


def _shardkit(model: torch.nn.Module) -> str | None:
    from shardkit.nn import apply_fused_kernels

    apply_fused_kernels(model)
    return None


def _shardkit_fp8(model: torch.nn.Module) -> str | None:
    from shardkit.precision.fp8 import FP8, fp8_supported

    reason = fp8_supported(next(model.parameters()).device)
    if reason is not None:
        return reason
    FP8().convert_module(model)
    return _shardkit(model)


_VARIANTS: dict[str, Callable[[torch.nn.Module], str | None]] = {
    "HF": lambda m: None, "HF + Liger": _liger, "HF + shardkit": _shardkit, "HF + shardkit, FP8 linears": _shardkit_fp8}


def _flops_per_token(model: torch.nn.Module, cfg: dict, seq: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    return 6.0 * n + 12.0 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


def _run_variant(name: str, patch, compiled: bool, args, cfg: dict, device: torch.device) -> list[str]:
    model = _build(cfg, device, "sdpa" if device.type == "cuda" else "eager")
    skipped = patch(model)
    if skipped is not None:
        return [name, "compile" if compiled else "eager", "-", "-", "-", "-", f"skipped: {skipped}"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    step_model = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=gen).to(device)

    def step() -> float:
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        for _ in range(args.warmup):
            step()
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            sync(device)
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return [name, "compile" if compiled else "eager", "OOM", "-", "-", "-", ""]
    step_s = sorted(times)[len(times) // 2]
    tokens_s = args.batch * args.seq / step_s
    peak = _peak_tflops(device, args.peak_tflops)
    mfu = f"{100 * _flops_per_token(model, cfg, args.seq) * tokens_s / (peak * 1e12):.1f}%" if peak else "n/a"
    mem = fmt_bytes(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else "n/a"
    return [name, "compile" if compiled else "eager", f"{step_s * 1e3:.1f}", f"{tokens_s:,.0f}", mfu, mem,
            f"loss {float(loss):.3f}"]


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, no figures")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (compile happens here)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--only", default=None, help="comma-separated variant names to run (default all)")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    cfg = _TINY if smoke else _LLAMA_1B
    args.batch = args.batch or (2 if smoke else 4)
    args.seq = args.seq or (32 if smoke else 4096)
    args.steps = args.steps or (2 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    print(f"# gpu_e2e: {machine_description(device)}; batch {args.batch} x seq {args.seq}, "
          f"{'smoke (tiny model, CPU)' if smoke else 'Llama 3.2 1B shape'}", flush=True)
    wanted = set(args.only.split(",")) if args.only else set(_VARIANTS)
    rows = []
    # Every eager variant before any compiled one: a lend that runs out of time still has the whole eager table.
    for compiled in (False,) if args.no_compile else (False, True):
        for name, patch in _VARIANTS.items():
            if name not in wanted:
                continue
            try:
                rows.append(_run_variant(name, patch, compiled, args, cfg, device))
            except Exception as exc:  # one variant's failure (a kernel, a compile) must not lose the others' rows
                rows.append([name, "compile" if compiled else "eager", "-", "-", "-", "-",
                             f"failed: {type(exc).__name__}: {str(exc)[:120]}"])
            print(" | ".join(rows[-1]), flush=True)
            _free(device)
    print_table(["variant", "mode", "step ms", "tokens/s", "MFU", "peak memory", "note"], rows)


if __name__ == "__main__":
    main()
