"""One-call GPU tuning sweep of the Triton rms_norm and AdamW launch settings (issue 28 item 3).

Run on a CUDA GPU: ``python3 benchmarks/gpu_tune.py`` (at most ~60 s, ``--budget-s``; scripts/gpu_session.sh runs it
in its bench phase). On CPU: ``python benchmarks/gpu_tune.py --smoke`` runs every code path once at tiny shapes
under Triton's interpreter (a check of the script, not a measurement).

1. rms_norm (4096, 4096) fp32 and bf16, forward+backward: the Triton kernels over fwd/bwd num_warps x backward
   programs per SM (``shardkit.kernels.rms_norm.LAUNCH``), beside the CUDA backend, torch eager (Hugging Face's
   LlamaRMSNorm) and Liger-Kernel's ``liger_rms_norm`` (skipped when it does not import).
2. AdamW at 100M fp32 parameters, as one tensor and as a Llama-like list of 48 tensors: the Triton kernel (one
   multi-tensor launch per step) over BLOCK x num_warps (``shardkit.kernels.adamw.LAUNCH``), beside
   torch.optim.AdamW(fused=True), foreach, and FusedAdamW on the CUDA backend.

Method: median of ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls, warmed up first) on
fresh random inputs (never zero). Every variant's outputs are compared once with the default setting's; a
variant outside tolerance is reported as FAIL and not timed. The CUDA backend is only used when the C++
extension is already built (kernels.py builds it earlier in the session), so that a build cannot eat the budget
(``--build-native`` allows one). Each section has a share of the budget; variants past it are listed as
skipped. Prints a short summary last; the full tables go to ``$OUT/gpu_tune.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_T0 = time.monotonic()  # the budget covers the sweeps; the total printed last also counts imports and CUDA init

import torch  # noqa: E402

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are first imported

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from shardkit.kernels import adamw as triton_adamw  # noqa: E402
from shardkit.kernels import rms_norm as triton_rms_norm  # noqa: E402
from shardkit.ops import BUILDER, force_backend  # noqa: E402
from shardkit.ops.rms_norm import rms_norm  # noqa: E402
from shardkit.optim import FusedAdamW  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _model_shapes import llama_like_sizes  # noqa: E402

Fn = Callable[[], object]
Settings = dict[str, int]


@dataclass
class Row:
    """One variant of one section: its time (ms, None when not timed) and its check against the default."""

    name: str
    settings: Settings | None = None  # None: a baseline (another implementation), not a Triton setting
    ms: float | None = None
    err: float | None = None  # max |a - b| / (atol + rtol |b|) over all outputs; <= 1 passes
    note: str = ""

    def setting_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items()) if self.settings else "-"


@dataclass
class Section:
    """A table: the rows of one shape/dtype, and the time left for it."""

    title: str
    deadline: float
    rows: list[Row] = field(default_factory=list)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


# ---- timing and checks ------------------------------------------------------------------------------------

def bench_ms(fn: Fn, device: torch.device, rep_ms: int) -> float:
    """Median milliseconds of ``fn()``: do_bench (CUDA events) on a GPU, wall clock on CPU (smoke only)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def err_ratio(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor], atol: float, rtol: float) -> float:
    """Worst |got - want| / (atol + rtol * |want|) over paired tensors (inf on a shape mismatch or a nan)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return math.inf
        a, b = a.float(), b.float()
        r = ((a - b).abs() / (atol + rtol * b.abs())).max().item()
        worst = max(worst, r if r == r else math.inf)
    return worst


def native_ready(allow_build: bool) -> bool:
    """The C++/CUDA extension is loaded or built already (or ``allow_build``): it cannot start a build here."""
    if os.environ.get("SHARDKIT_DISABLE_CPP") == "1":
        return False
    if allow_build or BUILDER._aot_library() is not None:  # noqa: SLF001 (a read-only probe)
        return BUILDER.available()
    marker = BUILDER.build_root() / f".built-{BUILDER.fingerprint()}"
    return marker.is_file() and not marker.read_text().startswith("fail:") and BUILDER.available()


def run_section(section: Section, variants: dict[str, tuple[Settings | None, Fn | None, Fn]], check: Fn,
                tol: tuple[float, float], device: torch.device, rep_ms: int) -> None:
    """Check then time every variant: name -> (settings, outputs() for the check or None, timed call).

    ``check()`` gives the default setting's outputs; a Triton variant that fails its check is not timed.
    """
    want = check()
    for name, (settings, outputs, timed) in variants.items():
        row = Row(name, settings)
        section.rows.append(row)
        if section.out_of_time():
            row.note = "skipped: out of budget"
            continue
        try:
            row.err = err_ratio(outputs(), want, *tol) if outputs is not None else None
            failed = row.err is not None and row.err > 1
            if failed:
                row.note = "FAIL: outputs differ from the default's" + ("" if settings else " (a baseline: timed)")
            if not (failed and settings):
                row.ms = bench_ms(timed, device, rep_ms)
        except Exception as e:  # noqa: BLE001 (a broken config is reported, and the sweep goes on)
            row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        print(f"  {section.title}: {name:<34} {row.setting_text():<44} "
              f"{'-' if row.ms is None else f'{row.ms:.3f} ms'} {row.note}", flush=True)


# ---- rms_norm ---------------------------------------------------------------------------------------------

def rms_norm_eager(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm forward."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@functools.cache  # import once: one "skipped" line, not one per dtype
def _liger_rms_norm() -> Callable | None:
    try:
        from liger_kernel.transformers.functional import liger_rms_norm
    except Exception as e:  # noqa: BLE001 (absent or broken: its column is skipped, with the reason)
        print(f"Liger-Kernel skipped: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None
    return lambda x, w: liger_rms_norm(x, w, 1e-6)


def _fwd_bwd(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, backend: str | None,
             settings: Settings | None = None) -> tuple[Fn, Fn]:
    """(outputs(), timed()) for forward+backward of ``fn(x, w)``; ours forced to ``backend`` with ``settings``."""
    def timed():
        with contextlib.ExitStack() as stack:
            if backend is not None:
                stack.enter_context(force_backend(backend))
            stack.enter_context(triton_rms_norm.LAUNCH.override(**(settings or {})))
            x.grad = w.grad = None
            y = fn(x, w)
            y.backward(dy)
            return y

    def outputs():
        y = timed()
        return [y.detach(), x.grad.clone(), w.grad.clone()]
    return outputs, timed


def _rms_variants(x, w, dy, grid: dict[str, tuple[int, ...]], native: str | None) -> dict:
    variants = {"triton default": (None, *_fwd_bwd(rms_norm, x, w, dy, "triton"))}
    if native is not None:
        variants[f"{native} backend"] = (None, *_fwd_bwd(rms_norm, x, w, dy, native))
    variants["torch eager (HF)"] = (None, *_fwd_bwd(rms_norm_eager, x, w, dy, None))
    liger = _liger_rms_norm()
    if liger is not None:
        # Liger writes dx over dy (in_place): it gets a dy of its own
        variants["Liger-Kernel"] = (None, *_fwd_bwd(liger, x, w, dy.clone(), None))
    for fw in grid["fwd_warps"]:
        for bw in grid["bwd_warps"]:
            for pp in grid["bwd_programs_per_sm"]:
                s = {"fwd_warps": fw, "bwd_warps": bw, "bwd_programs_per_sm": pp}
                variants[f"triton fw{fw} bw{bw} p{pp}"] = (s, *_fwd_bwd(rms_norm, x, w, dy, "triton", s))
    return variants


def sweep_rms_norm(section: Section, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                   grid: dict[str, tuple[int, ...]], native: str | None, rep_ms: int) -> None:
    """rms_norm forward+backward at ``shape``: the Triton grid beside the other implementations."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device).to(dtype).requires_grad_()
    w = (1.0 + 0.1 * torch.randn(shape[1], generator=g, device=device)).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g, device=device).to(dtype)
    variants = _rms_variants(x, w, dy, grid, native)
    default_outputs = variants["triton default"][1]
    tol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)  # bf16: 1 ulp is 0.8% (rounding of rstd)
    run_section(section, variants, default_outputs, tol, device, rep_ms)


# ---- AdamW ------------------------------------------------------------------------------------------------

def _adamw_tensors(sizes: list[int], device: torch.device):
    """Params with random grads; for the direct-kernel check a frozen copy of them and random (never zero)
    moments (the timed optimizers change the params)."""
    g = torch.Generator(device=device).manual_seed(1)
    ps = [torch.randn(n, generator=g, device=device).requires_grad_() for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-2
    ms = [torch.randn(n, generator=g, device=device) * 1e-3 for n in sizes]
    vs = [torch.rand(n, generator=g, device=device) * 1e-6 + 1e-9 for n in sizes]
    frozen = ([p.detach().clone() for p in ps], [p.grad for p in ps], ms, vs)
    return ps, frozen


def _adamw_outputs(frozen, settings: Settings | None) -> Fn:
    """outputs(): one Triton AdamW step (step 3) on copies of the frozen tensors, under ``settings``."""
    def outputs():
        p0, g, m0, v0 = frozen
        p, m, v = ([t.clone() for t in ts] for ts in (p0, m0, v0))
        k = len(p)
        with triton_adamw.LAUNCH.override(**(settings or {})):
            triton_adamw.adamw_step_(p, g, m, v, [], [1e-3 / (1 - 0.9**3)] * k, [math.sqrt(1 - 0.999**3)] * k,
                                     1e-3, 0.9, 0.999, 1e-8, 0.01, False)
        return p + m + v
    return outputs


def _stepper(opt: torch.optim.Optimizer, backend: str | None, settings: Settings | None = None) -> Fn:
    def step():
        with contextlib.ExitStack() as stack:
            if backend is not None:
                stack.enter_context(force_backend(backend))
            stack.enter_context(triton_adamw.LAUNCH.override(**(settings or {})))
            opt.step()
    return step


def _adamw_variants(ps, frozen, grid: dict[str, tuple[int, ...]], native: str | None) -> dict:
    # baselines keep optimizer states of their own: only the Triton variants are checked (against the default)
    ours = FusedAdamW(ps, lr=1e-3, weight_decay=0.01)
    variants = {"triton default": (None, _adamw_outputs(frozen, None), _stepper(ours, "triton"))}
    if native is not None:
        own = FusedAdamW(ps, lr=1e-3, weight_decay=0.01)
        variants[f"{native} backend"] = (None, None, _stepper(own, native))
    for label, kw in (("torch AdamW fused", {"fused": True}), ("torch AdamW foreach", {"foreach": True})):
        variants[label] = (None, None, _stepper(torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw), None))
    # fewest elements per thread first: the spilling settings come last (see FULL)
    pairs = sorted(((b, w) for b in grid["block"] for w in grid["num_warps"]), key=lambda bw: bw[0] / bw[1])
    for block, warps in pairs:
        s = {"block": block, "num_warps": warps}
        variants[f"triton B{block} w{warps}"] = (s, _adamw_outputs(frozen, s), _stepper(ours, "triton", s))
    return variants


def sweep_adamw(section: Section, sizes: list[int], device: torch.device, grid: dict[str, tuple[int, ...]],
                native: str | None, rep_ms: int) -> None:
    """One AdamW step over params of ``sizes`` (fp32): the Triton grid beside torch's and the CUDA backend."""
    ps, frozen = _adamw_tensors(sizes, device)
    variants = _adamw_variants(ps, frozen, grid, native)
    for _, _, step in variants.values():
        if not section.out_of_time():
            step()  # first step: the optimizer states exist (and are nonzero) before anything is timed
    # elementwise, same operation order whatever the launch: every setting must agree to rounding
    run_section(section, variants, variants["triton default"][1], (1e-6, 1e-5), device, rep_ms)


# ---- report -----------------------------------------------------------------------------------------------

def _ms(row: Row) -> str:
    return "-" if row.ms is None else f"{row.ms:.3f}"


def full_table(section: Section) -> str:
    """Every row, fastest first (untimed ones last), with the speed-up over the Triton default."""
    default = next((r.ms for r in section.rows if r.name == "triton default"), None)
    rows = sorted(section.rows, key=lambda r: (r.ms is None, r.ms or 0.0))
    lines = [f"## {section.title}", "",
             "| variant | setting | ms (median) | default/this | check err/tol | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{default / r.ms:.2f}x" if default and r.ms else "-"
        err = "-" if r.err is None else f"{r.err:.2g}"
        lines.append(f"| {r.name} | {r.setting_text()} | {_ms(r)} | {ratio} | {err} | {r.note} |")
    return "\n".join(lines)


def summary(section: Section) -> list[str]:
    """Two lines: the best Triton setting against the default, then the other implementations."""
    timed = [r for r in section.rows if r.ms is not None]
    tri = [r for r in timed if r.name.startswith("triton")]
    default = next((r for r in timed if r.name == "triton default"), None)
    if not tri:
        return [f"{section.title}: nothing timed ({section.rows[0].note if section.rows else 'no variants'})"]
    best = min(tri, key=lambda r: r.ms)
    gain = f" = {default.ms / best.ms:.2f}x the default ({_ms(default)} ms)" if default else ""
    others = [r for r in timed if not r.name.startswith("triton")]
    bad = sum(1 for r in section.rows if r.settings and r.note.startswith(("FAIL", "error")))
    skipped = sum(1 for r in section.rows if r.note.startswith("skipped"))
    return [f"{section.title}: best triton {best.setting_text() if best.settings else '(default)'}: "
            f"{_ms(best)} ms{gain}",
            "    " + " | ".join(f"{r.name} {_ms(r)} ms" for r in others)
            + f"   [{len(tri)} triton timed, {bad} failed, {skipped} skipped]"]


def header(device: torch.device, native: str | None) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: Triton interpreter)"
    sms = f", {torch.cuda.get_device_properties(device).multi_processor_count} SMs" if device.type == "cuda" else ""
    rows, n = (FULL if device.type == "cuda" else SMOKE)["rms"]
    rms = " ".join(f"{k}={v}" for k, v in triton_rms_norm.launch_settings(n, rows, device).items())
    block, warps = triton_adamw.launch_settings(device.type == "cuda")
    return (f"# gpu_tune: {name}{sms}; torch {torch.__version__}, triton {triton.__version__}; "
            f"native backend: {native or 'not used (extension not built)'}\n"
            f"# 'triton default' is rms_norm {rows}x{n}: {rms}; AdamW: block={block} num_warps={warps}")


def write_report(sections: list[Section], head: str, start: float) -> str:
    """Full tables, then the short summary; also written to $OUT/gpu_tune.txt when $OUT is set."""
    short = [line for s in sections for line in summary(s)]
    elapsed = f"sweeps {time.monotonic() - start:.1f} s, process {time.monotonic() - _T0:.1f} s"
    report = "\n\n".join(full_table(s) for s in sections) + "\n\n" + "\n".join(short) + "\n" + elapsed
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_tune.txt").write_text(head + "\n\n" + report + "\n")
    return report


# ---- main -------------------------------------------------------------------------------------------------

# Grid order: the settings most likely to win first, so that a section cut short by the budget loses the least.
# Compiled for sm_90 here (scripts/check_triton.py with LAUNCH overrides, n=4096): rms_norm bwd at 4 warps takes
# 197-204 registers/thread (12% occupancy), at 16 warps 63-64 (50%). The multi-tensor AdamW (fp32 / bf16 with
# fp32 master): 8 elements a thread (B2048 w8, the default; B4096 w16) 53-80 registers, 16 (B4096 w8) 104-128,
# 32 (B4096 w4) 182-254; the per-tensor kernel before it spilled from 64 elements a thread (B8192 w4).
FULL = {"rms": (4096, 4096), "rms_grid": {"fwd_warps": (8, 16, 32, 4), "bwd_warps": (16, 32, 8, 4),
                                          "bwd_programs_per_sm": (1, 2, 4)},
        "adamw": ([100_000_000], llama_like_sizes(1024, 2816, 16_000, 5)),  # 1 x 100M; 48 tensors, 97.0M
        "adamw_grid": {"block": (1024, 2048, 4096, 8192), "num_warps": (4, 8, 16)}}
SMOKE = {"rms": (16, 96), "rms_grid": {"fwd_warps": (4,), "bwd_warps": (4, 8), "bwd_programs_per_sm": (1, 2)},
         "adamw": ([10_007], llama_like_sizes(16, 40, 50, 2)),
         "adamw_grid": {"block": (1024, 2048), "num_warps": (4, 8)}}


def plan(cfg: dict, device: torch.device, native: str | None, rep_ms: int) -> list[tuple[str, float, Fn]]:
    """(title, weight, run(section)) for the four sections, in order.

    A section gets the time left times its weight over the weights still to come, so what one leaves unused
    goes to the next. Most of a section's time is Triton compiling its grid (about 12 kernels per rms_norm
    dtype, 12 for AdamW). The Llama-like AdamW comes first (a model's many tensors: what the multi-tensor launch
    is for); the 1-tensor section reuses its kernels, hence its small weight.
    """
    one, many = cfg["adamw"]
    shape = cfg["rms"]
    out = []
    for weight, dt in ((0.3, torch.float32), (0.3, torch.bfloat16)):
        title = f"rms_norm {shape} {str(dt).removeprefix('torch.')} fwd+bwd"
        out.append((title, weight, lambda s, dt=dt: sweep_rms_norm(s, shape, dt, device, cfg["rms_grid"], native,
                                                                  rep_ms)))
    for weight, sizes, what in ((0.28, many, f"{len(many)} tensors (Llama-like)"), (0.12, one, "1 tensor")):
        title = f"AdamW fp32 {sum(sizes) / 1e6:.3g}M params, {what}"
        out.append((title, weight, lambda s, z=sizes: sweep_adamw(s, z, device, cfg["adamw_grid"], native, rep_ms)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, every code path once (CPU: interpreter)")
    parser.add_argument("--budget-s", type=float, default=50.0,
                        help="seconds for the four sections together (imports and CUDA init come on top: ~5 s)")
    parser.add_argument("--rep-ms", type=int, default=25, help="do_bench's measuring time per variant")
    parser.add_argument("--build-native", action="store_true", help="build the C++/CUDA extension if needed")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("gpu_tune: no CUDA GPU here. It is a GPU sweep; `--smoke` checks the script on CPU.", file=sys.stderr)
        return 2
    want = "cuda" if device.type == "cuda" else "cpp"
    native = want if native_ready(args.build_native) else None
    print(header(device, native), flush=True)
    start = time.monotonic()
    sections: list[Section] = []
    report = ""
    steps = plan(SMOKE if args.smoke else FULL, device, native, args.rep_ms)
    for i, (title, weight, run) in enumerate(steps):
        left = start + args.budget_s - time.monotonic()
        section = Section(title, time.monotonic() + max(0.0, left) * weight / sum(w for _, w, _ in steps[i:]))
        sections.append(section)
        print(f"== {title} (+{time.monotonic() - start:.1f} s)", flush=True)
        try:
            run(section)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the next section still runs)
            section.rows.append(Row("section", note=f"error: {type(e).__name__}: {str(e)[:160]}"))
            print(f"  {title}: error: {type(e).__name__}: {str(e)[:160]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report = write_report(sections, header(device, native), start)  # after each section: a kill loses little
    print("\n" + report, flush=True)
    if os.environ.get("OUT"):
        print(f"full table: {Path(os.environ['OUT']) / 'gpu_tune.txt'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
