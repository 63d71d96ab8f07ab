"""Fused kernels side by side: each op (forward+backward), fused linear cross-entropy, FusedAdamW.

Run: ``.venv/bin/python benchmarks/kernels.py`` (about 5 minutes on 2 CPU cores; ``--quick`` for a smoke run at
tiny shapes). Device-agnostic: on a GPU it benchmarks the cuda/triton backends (and Liger-Kernel when it is
installed), on CPU the cpp backend. Results go in benchmarks/RESULTS.md.

Method: medians of repeated runs after warmup (``_timing.median_time``); peak memory is what one call adds at
its peak over what was live before it (``_timing.peak_memory``: CUDA allocator peak, or the process's peak
resident set on CPU, see that module). Inputs are allocated before the measurement, so peaks count outputs,
saved activations, gradients and temporaries.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _model_shapes import llama_like_sizes  # noqa: E402
from _timing import (  # noqa: E402
    ensure_malloc_returns_memory,
    fmt_bytes,
    machine_description,
    median_time,
    peak_memory,
    print_table,
    sync,
)

ensure_malloc_returns_memory()  # before any large allocation (re-executes the script once)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardkit.ops import available_backends, force_backend, get_op, registered_ops  # noqa: E402
from shardkit.ops.fused_linear_cross_entropy import (  # noqa: E402
    chunk_rows_for,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from shardkit.ops.registry import OpSpec  # noqa: E402
from shardkit.optim import FusedAdamW  # noqa: E402

Fn = Callable[[], object]


# ---- the torch eager versions (what Hugging Face's modeling code does) --------------------------------------

def rms_norm_eager(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_eager(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu_eager(gate, up):
    return F.silu(gate) * up


def geglu_eager(gate, up):
    return F.gelu(gate, approximate="tanh") * up  # Gemma's MLP


def layer_norm_eager(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


# ---- per-op forward+backward ----------------------------------------------------------------------------

def _leaf(*shape, dtype, device, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device, dtype).requires_grad_(grad)


def _clear_grads(tensors: list[torch.Tensor]) -> Fn:
    def clear():
        for t in tensors:
            t.grad = None
    return clear


def _forced(fn: Fn, backend: str | None) -> Fn:
    """``fn`` with our ops forced to ``backend`` for the whole call (backward dispatches again); None: as is."""
    def call():
        with force_backend(backend) if backend else contextlib.nullcontext():
            return fn()
    return call


def _fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grads_out: list[torch.Tensor],
             backend: str | None = None) -> Fn:
    """One forward+backward of ``fn(*inputs)`` against the given output gradients."""
    def run():
        _clear_grads(inputs)()
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(out, grads_out)
    return _forced(run, backend)


@dataclass
class OpCase:
    """One op at one shape and dtype: ours, torch eager (what HF modeling code does) and Liger-Kernel's."""

    label: str
    ours: Callable
    eager: Callable
    liger: Callable | None
    inputs: list[torch.Tensor]
    grads_out: list[torch.Tensor]
    op: str = "rms_norm"


def _liger_functional():
    """Liger-Kernel's functional ops (GPU only: its Triton kernels do not run under the CPU interpreter)."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    return functional


# Per op (by registered name): the torch eager version Hugging Face's modeling code runs (default: the op's own
# reference) and Liger-Kernel's functional version (default: none). Ops with a section of their own below
# (fused linear cross-entropy, AdamW) are left out of the per-op table.
_EAGER: dict[str, Callable] = {"rms_norm": rms_norm_eager, "rope": rope_eager, "swiglu": swiglu_eager,
                               "geglu": geglu_eager, "layer_norm": layer_norm_eager}
_LIGER: dict[str, Callable] = {"rms_norm": lambda lg: lambda x, w: lg.liger_rms_norm(x, w, 1e-6),
                               "rope": lambda lg: lg.liger_rope, "swiglu": lambda lg: lg.liger_swiglu,
                               "geglu": lambda lg: lg.liger_geglu,
                               "layer_norm": lambda lg: lambda x, w, b: lg.liger_layer_norm(x, w, b, 1e-5),
                               "cross_entropy": lambda lg: lambda z, t: lg.liger_cross_entropy(z, t)}
_OWN_SECTION = ("fused_linear_cross_entropy",)
_GLU_OPS = ("swiglu", "geglu")  # also measured as an MLP runs them (bench_glu_mlp)
# bf16 on CPU only for rms_norm: keeps the CPU run near 5 minutes
_CPU_FP32_ONLY = ("rope", "swiglu", "geglu", "layer_norm", "cross_entropy")


def _case(spec: OpSpec, device: str, dtype: torch.dtype, quick: bool, lg) -> OpCase:
    """``spec.example`` at the benchmark's shape (the test's tiny one with ``quick``), with output gradients."""
    args = spec.example(device, dtype, "test" if quick else "bench")
    with torch.no_grad():
        outs = spec.reference(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads_out = [_leaf(*o.shape, dtype=o.dtype, device=device, seed=100 + i, grad=False) for i, o in enumerate(outs)]
    shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
    liger = _LIGER[spec.name](lg) if lg is not None and spec.name in _LIGER else None
    # GLU ops on leaves: ours keeps the gradients out of place there (see bench_glu_mlp for the model's way)
    leaf = " (leaf inputs)" if spec.name in _GLU_OPS else ""
    return OpCase(f"{spec.name} {shapes} {str(dtype)[6:]}{leaf}", spec.function, _EAGER.get(spec.name, spec.reference),
                  liger, list(args), grads_out, spec.name)


def op_cases(device: str, quick: bool) -> list[OpCase]:
    """Every registered op with an example, per dtype, at the shapes of the issue; on a GPU in fp32 and bf16."""
    lg = _liger_functional() if device != "cpu" else None
    cases = []
    for spec in registered_ops():
        if spec.example is None or spec.name in _OWN_SECTION:
            continue
        cpu_fp32 = device == "cpu" and spec.name in _CPU_FP32_ONLY
        for dt in (torch.float32,) if cpu_fp32 else (torch.float32, torch.bfloat16):
            cases.append(_case(spec, device, dt, quick, lg))
    return cases


def _our_backends(device: str, op: str = "rms_norm") -> list[str]:
    """The op's fused backends that run here, best first: cpp on CPU; cuda and triton on a GPU. An op with no
    native kernel (layer_norm, cross_entropy: Triton only) runs its reference on CPU."""
    spec = get_op(op)
    kernel = (spec.native_kernels or tuple(spec.kernels))[0]
    found = [b for b in available_backends(device, kernel) if b != "reference" and (device != "cpu" or b != "triton")]
    return found or ["reference"]


def bench_ops(device: str, quick: bool) -> str:
    reps = 3 if quick else 5
    warmup_s = 0.0 if quick else 1.0  # on CPU: until freed huge pages are being reused (see median_time)
    rows = []
    for case in op_cases(device, quick):
        def measure(run):
            return (median_time(run, warmup=2, repeats=reps, device=device, warmup_s=warmup_s),
                    peak_memory(run, device, setup=_clear_grads(case.inputs)))

        others = {"eager": case.eager, "compile": torch.compile(case.eager, dynamic=False)}
        if case.liger is not None:
            others["liger"] = case.liger
        # NOTE: Liger's RMSNorm backward writes dX over dY by default (in_place=True): it gets its own copy of
        # the output gradients, so the contenders measured after it see the same values as before it
        res = {name: measure(_fwd_bwd(fn, case.inputs, [g.clone() for g in case.grads_out] if name == "liger"
                                      else case.grads_out)) for name, fn in others.items()}
        for backend in _our_backends(device, case.op):
            t, mem = measure(_fwd_bwd(case.ours, case.inputs, case.grads_out, backend))
            cells = [f"{res[k][0] * 1e3:.2f} ms / {fmt_bytes(res[k][1])}" if k in res else "n/a"
                     for k in ("eager", "compile", "liger")]
            ratios = [f"{res[k][0] / t:.2f}x" if k in res else "n/a" for k in ("eager", "compile", "liger")]
            rows.append([case.label, backend, f"{t * 1e3:.2f} ms / {fmt_bytes(mem)}", *cells, *ratios])
            print(rows[-1], flush=True)
    print("\nOps, forward+backward: time median / peak memory; ratios > 1 mean ours is faster", flush=True)
    return print_table(["op", "ours: backend", "ours", "torch eager", "torch.compile", "Liger-Kernel",
                        "eager/ours", "compile/ours", "liger/ours"], rows)


# ---- SwiGLU / GeGLU as an MLP runs them --------------------------------------------------------------------

class _FreshGluInputs:
    """gate and up made fresh for every call, as an MLP's two linears make them: ``setup()`` (outside the timed
    and measured window) computes them from ``x``, ``run()`` consumes them in one forward+backward.

    On these inputs ours may write its gradients over gate and up (``in_place_backward=True``, what
    ``SwiGLUMLP``/``GeGLUMLP`` and the Hugging Face patch pass), which it refuses on the per-op table's leaf
    inputs; Liger-Kernel writes over its inputs in both.
    """

    def __init__(self, fn: Callable, m: int, f: int, dtype: torch.dtype, device: str, dy: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(0)
        # inner size 16: making gate and up costs little, and x's gradient (m, 16) is small beside (m, f)
        self.x = torch.randn(m, 16, generator=gen).to(device, dtype).requires_grad_()
        self.w_gate, self.w_up = (torch.randn(f, 16, generator=gen).to(device, dtype) for _ in range(2))
        self.fn, self.dy, self.held = fn, dy, []

    def setup(self) -> None:
        self.x.grad = None
        self.held[:] = [self.x @ self.w_gate.T, self.x @ self.w_up.T]

    def run(self) -> None:
        gate, up = self.held
        self.held.clear()  # the op's graph holds them from here, as in a model
        self.fn(gate, up).backward(self.dy)


def _time_with_setup(case: _FreshGluInputs, device: str, repeats: int, backend: str | None) -> float:
    """Median seconds of ``case.run()`` alone, a fresh ``case.setup()`` before each call (after 2 warmup calls)."""
    times = []
    with force_backend(backend) if backend else contextlib.nullcontext():
        for i in range(repeats + 2):
            case.setup()
            sync(device)
            t0 = time.perf_counter()
            case.run()
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _glu_contenders(name: str, device: str, lg) -> dict[str, tuple[Callable, str | None]]:
    """label -> (fn(gate, up), backend forced for ours)."""
    eager = _EAGER[name]
    out: dict[str, tuple[Callable, str | None]] = {"torch eager": (eager, None),
                                                    "torch.compile": (torch.compile(eager, dynamic=False), None)}
    if lg is not None:
        out["Liger-Kernel"] = (_LIGER[name](lg), None)
    ours = get_op(name).function
    for backend in _our_backends(device, name):
        out[f"ours ({backend})"] = (lambda g, u, ours=ours: ours(g, u, in_place_backward=True), backend)
    return out


def bench_glu_mlp(device: str, quick: bool) -> str:
    """SwiGLU and GeGLU forward+backward with gate and up fresh linear outputs (see :class:`_FreshGluInputs`)."""
    m, f = (64, 352) if quick else (4096, 11008)
    lg = _liger_functional() if device != "cpu" else None
    rows = []
    for name in _GLU_OPS:
        for dt in (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16):
            dy = _leaf(m, f, dtype=dt, device=device, seed=100, grad=False)
            act = m * f * dt.itemsize
            res = {}
            for label, (fn, backend) in _glu_contenders(name, device, lg).items():
                case = _FreshGluInputs(fn, m, f, dt, device, dy)
                t = _time_with_setup(case, device, 3 if quick else 10, backend)
                mem = peak_memory(_forced(case.run, backend), device, setup=case.setup)
                res[label] = (t, mem)
            liger = res.get("Liger-Kernel")
            for label, (t, mem) in res.items():
                rows.append([f"{name} ({m}, {f}) {str(dt)[6:]}", label, f"{t * 1e3:.2f} ms",
                             fmt_bytes(mem), f"{mem / act:.2f}x" if mem is not None else "n/a",
                             f"{liger[0] / t:.2f}x" if liger else "n/a",
                             f"{mem / liger[1]:.2f}" if liger and mem and liger[1] else "n/a"])
                print(rows[-1], flush=True)
    print("\nSwiGLU / GeGLU in an MLP (gate and up fresh linear outputs, ours with in_place_backward=True): "
          "forward+backward; peak in units of one activation; ratios > 1 mean ours is faster", flush=True)
    return print_table(["op", "implementation", "time (median)", "peak memory", "peak / activation",
                        "liger/this time", "this/liger peak"], rows)


# ---- fused linear cross-entropy ---------------------------------------------------------------------------

class _PlainChunked(torch.autograd.Function):
    """The plain chunked baseline in torch ops: per chunk of rows, logits -> softmax - onehot -> two matmuls."""

    @staticmethod
    def forward(ctx, h, w, y, chunk):
        gh, gw = torch.empty_like(h), torch.zeros_like(w, dtype=torch.float32)
        loss = h.new_zeros((), dtype=torch.float32)
        n_valid = (y != -100).sum().clamp(min=1)
        for i in range(0, h.shape[0], chunk):
            hc, yc = h[i:i + chunk], y[i:i + chunk]
            z = (hc @ w.t()).float()
            loss += F.cross_entropy(z, yc, reduction="sum")
            p = z.softmax(-1)
            p[torch.arange(len(yc)), yc] -= 1  # d loss / d z of the sum (the benchmark labels ignore no row)
            p /= n_valid
            pz = p.to(h.dtype)
            gh[i:i + chunk] = pz @ w
            gw.addmm_(pz.t().float(), hc.float())
        ctx.save_for_backward(gh, gw.to(w.dtype))
        return loss / n_valid

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return gh * g, gw * g, None, None


def bench_flce(device: str, quick: bool, dt: torch.dtype = torch.float32) -> str:
    full = (4096, 2048, 128256)
    cpu = device == "cpu"
    t_rows, hid, vocab = (512, 256, 2048) if quick else ((4096, 2048, 8192) if cpu else full)
    # NOTE: the chunk the op picks at the full size (512 rows in fp32, 256 in 16-bit: a 256 MiB logits budget);
    # kept at the reduced V so the memory terms (T*V logits vs chunk*V) keep the full-size proportions.
    chunk = chunk_rows_for(full[0], full[2], dt) if not quick else 128
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(t_rows, hid, generator=g) * 0.5).to(device, dt).requires_grad_()
    w = (torch.randn(vocab, hid, generator=g) / hid**0.5).to(device, dt).requires_grad_()
    y = torch.randint(0, vocab, (t_rows,), generator=g).to(device)
    # name -> (loss, backend forced for ours)
    variants: dict[str, tuple[Callable[[], torch.Tensor], str | None]] = {
        "naive (logits + F.cross_entropy)": (lambda: linear_cross_entropy_reference(h, w, y), None),
        "plain chunked (torch ops)": (lambda: _PlainChunked.apply(h, w, y, chunk), None),
    }
    for backend in _our_backends(device, "fused_linear_cross_entropy"):
        variants[f"ours fused ({backend})"] = (lambda: fused_linear_cross_entropy(h, w, y, chunk_rows=chunk), backend)
        if not cpu and dt != torch.float32 and backend == "triton":
            # the Python loop holds one 16-bit chunk: at half the rows (Liger's 128 at T=4096 V=128256) its peak
            # is Liger's; what the smaller GEMMs cost in time decides the default (issue 28 item 2)
            variants[f"ours fused ({backend}, {chunk // 2}-row chunks)"] = (
                lambda: fused_linear_cross_entropy(h, w, y, chunk_rows=chunk // 2), backend)
    lg = _liger_functional() if not cpu else None
    if lg is not None:
        variants["liger"] = (lambda: lg.liger_fused_linear_cross_entropy(h, w, y), None)
    runs = {}
    for name, (loss_fn, backend) in variants.items():
        def run(loss_fn=loss_fn):
            h.grad = w.grad = None
            loss_fn().backward()
        runs[name] = _forced(run, backend)
    naive = "naive (logits + F.cross_entropy)"
    if cpu:
        # ~4-6 s a call at the CPU size, and this shared CPU's matmul speed drifts by ±30% over a minute: one
        # warmup call each (MKL's first-call buffers would count as peak memory), then rounds in which every
        # variant runs once, timed and measured; the ratio to naive is taken within each round.
        rounds = 1 if quick else 3
        for run in runs.values():
            run()
        times: dict[str, list[float]] = {k: [] for k in runs}
        peaks: dict[str, list[int | None]] = {k: [] for k in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                peaks[name].append(peak_memory(run, device, setup=_clear_grads([h, w])))
                times[name].append(time.perf_counter() - t0)
        res = {k: (statistics.median(times[k]), None if None in peaks[k] else max(peaks[k])) for k in runs}
        ratio = {k: statistics.median(t / b for t, b in zip(times[k], times[naive])) for k in runs}
        print("seconds per round:", {k: [round(t, 2) for t in v] for k, v in times.items()}, flush=True)
    else:
        res = {k: (median_time(run, warmup=2, repeats=10, device=device),
                   peak_memory(run, device, setup=_clear_grads([h, w]))) for k, run in runs.items()}
        ratio = {k: res[k][0] / res[naive][0] for k in runs}
    base_m = res[naive][1]
    rows = [[k, f"{t:.2f} s", fmt_bytes(m), f"{ratio[k]:.2f}x", f"{m / base_m:.3f}" if m and base_m else "n/a"]
            for k, (t, m) in res.items()]
    print(f"\nFused linear cross-entropy fwd+bwd, T={t_rows} H={hid} V={vocab} {str(dt)[6:]}, chunk {chunk} rows; "
          "naive upcasts the logits to fp32 as Hugging Face does", flush=True)
    table = print_table(["variant", "time", "peak memory", "time vs naive", "memory vs naive"], rows)
    if (t_rows, hid, vocab) != full and dt == torch.float32:
        estimate = flce_full_size_estimate(*full, 512)  # the default chunk at full V, fp32
        print(estimate, flush=True)
        table += "\n\n" + estimate
    return table


def flce_full_size_estimate(t: int, h: int, v: int, chunk: int) -> str:
    """Peak memory at the full size, analytically (fp32, bytes), for the naive path and the fused op."""
    gib = 2**30
    # naive: logits (T,V) and the log-softmax cross_entropy saves (T,V); in backward the gradients of both
    # (T,V) while the saved log-softmax is alive: 3 (T,V) at once, plus grad_weight (V,H) and grad_hidden (T,H)
    naive = 3 * t * v * 4 + v * h * 4 + t * h * 4
    # fused: one chunk of logits/gradient (chunk,V), the fp32 grad_weight (V,H) and grad_hidden (T,H) computed
    # in forward and saved; backward scales them in place by the upstream gradient (no second copy)
    fused = chunk * v * 4 + v * h * 4 + t * h * 4
    return (f"Full size T={t} H={h} V={v} fp32, analytical: naive {naive / gib:.2f} GiB, fused {fused / gib:.2f} GiB "
            f"(ratio {fused / naive:.3f}); FLOPs fwd+bwd 3 x 2*T*H*V = {6 * t * h * v / 1e12:.1f} TFLOP.")


# ---- AdamW ---------------------------------------------------------------------------------------------

def _pieces(n: int, piece: int = 1 << 22) -> list[int]:
    """``n`` parameters in tensors of ``piece`` elements (the last one ragged)."""
    return [piece] * (n // piece) + ([n % piece] if n % piece else [])


def _adamw_cases(device: str, quick: bool) -> list[tuple[str, list[int]]]:
    """(label, parameter sizes) per AdamW case; the many-tensor case is a GPU one."""
    if quick:
        cases, many = [("1M", _pieces(1 << 20)), ("4M", _pieces(4 << 20, 1 << 20))], llama_like_sizes(64, 176, 500, 2)
    else:  # 110M in 111 tensors: a model's mix of sizes
        cases, many = [(f"{n / 1e6:.0f}M", _pieces(n)) for n in (10_000_000, 100_000_000)], llama_like_sizes(
            768, 2048, 16_000, 12)
    label = f"{sum(many) / 1e6:.3g}M in {len(many)} tensors"
    if device == "cpu":
        print(f"AdamW {label} (the Triton multi-tensor launch beside torch's fused and foreach AdamW): GPU-only "
              "rows, not run on CPU (Triton runs there only interpreted)", flush=True)
        return cases
    return cases + [(label, many)]


def _params(sizes: list[int], device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).to(device).requires_grad_() for s in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device) * 1e-2
    return ps


def _optimizers(device: str) -> dict[str, tuple[Callable[[list[torch.Tensor]], torch.optim.Optimizer], str | None]]:
    """name -> (factory, backend forced for ours)."""
    opts = {f"ours FusedAdamW ({b})": (lambda ps: FusedAdamW(ps, lr=1e-3, weight_decay=0.01), b)
            for b in _our_backends(device, "adamw")}
    opts |= {"torch AdamW foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), None),
             "torch AdamW fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), None)}
    if device == "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            DeepSpeedCPUAdam([torch.zeros(1, requires_grad=True)])  # JIT-builds cpu_adam once (~90 s first time)
            opts["DeepSpeedCPUAdam"] = (lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, adamw_mode=True), None)
        except Exception as e:  # noqa: BLE001 (any build/import failure means: skip it, with the reason)
            print(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return opts


def _interleaved(fns: dict[str, Fn], rounds: int, device: str) -> dict[str, list[float]]:
    """Per-call times of every fn, round-robin (one call of each per round) after one warmup call each.

    On a shared machine the load changes within seconds; interleaving gives every contender the same mix.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return times


def bench_adamw(device: str, quick: bool) -> str:
    """Optimizer steps on the same params/grads (separate states), interleaved with a 1 GiB in-place triad."""
    m = (1 << 24) if quick else (1 << 28)  # 2^28 fp32 = 1 GiB per triad array
    a, b = torch.rand(m, device=device), torch.rand(m, device=device)
    rows = []
    for label, sizes in _adamw_cases(device, quick):
        n = sum(sizes)
        ps = _params(sizes, device)
        fns: dict[str, Fn] = {name: _forced(make(ps).step, backend)
                              for name, (make, backend) in _optimizers(device).items()}
        fns["floor: triad a += c*b"] = lambda: a.add_(b, alpha=1e-3)
        times = _interleaved(fns, rounds=5, device=device)
        floor_round = [t * 28 * n / (12 * m) for t in times.pop("floor: triad a += c*b")]  # 28 B/param at triad BW
        best_floor = min(floor_round)
        for name, ts in times.items():
            med = statistics.median(ts)
            same_round = statistics.median(t / f for t, f in zip(ts, floor_round))
            rows.append([label, name, f"{med * 1e3:.1f} ms", f"{28 * n / med / 1e9:.1f} GB/s",
                         f"{med / best_floor:.2f}x", f"{same_round:.2f}x"])
            print(rows[-1], flush=True)
        tri = [12 * m / (f * 12 * m / (28 * n)) / 1e9 for f in floor_round]
        print(f"{label}: triad GB/s per round {', '.join(f'{x:.1f}' for x in tri)}", flush=True)
        del ps, fns
    print("\nAdamW step, fp32 (28 B/param): median of 5 interleaved rounds; floor = 28 B/param at the in-place "
          "triad's bandwidth (1 GiB arrays, 12 B/elem), best round / same round", flush=True)
    return print_table(["params", "optimizer", "step (median)", "effective GB/s", "vs best floor",
                        "vs floor, same round (median)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, not a measurement")
    parser.add_argument("--only", choices=("ops", "glu", "flce", "adamw"), action="append",
                        help="ops: the per-op table and the GLU-in-an-MLP table; glu: that table alone")
    parser.add_argument("--flce-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype of hidden and weight in the fused linear cross-entropy comparison")
    args = parser.parse_args()
    only = set(args.only or ("ops", "flce", "adamw"))
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M} {machine_description(args.device)}, "
          f"python {platform.python_version()}, load {os.getloadavg()[0]:.2f}", flush=True)
    if "ops" in only:
        bench_ops(args.device, args.quick)
    if "ops" in only or "glu" in only:
        bench_glu_mlp(args.device, args.quick)
    if "flce" in only:
        bench_flce(args.device, args.quick, getattr(torch, args.flce_dtype))
    if "adamw" in only:
        bench_adamw(args.device, args.quick)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
