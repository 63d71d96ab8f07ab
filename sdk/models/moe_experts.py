"""SwiGLU experts held as stacked weights, computed over token assignments sorted by expert.

The weights use Hugging Face's layout (Qwen3-MoE, Mixtral in transformers 5), so they map one to one:
``gate_up_proj`` (E, 2 * I, H), the gate's rows first, and ``down_proj`` (E, H, I).

Two entry points:

- :func:`routed_swiglu` ``(x, token, weights, counts, ...)``: the whole routed part of an MoE layer, from the
  tokens ``x`` (N, H) to their weighted sum of expert outputs (N, H): gather each assignment's token, the expert's
  SwiGLU, the routing weight, the sum per token.
- :func:`grouped_swiglu` ``(tokens, counts, ...)``: only the SwiGLU, over rows already sorted by expert (what
  expert parallelism runs on the rows it received).

Both run as one autograd function whose backward is written out, so that a step keeps only what it needs: the
input tokens (which the router keeps alive anyway), the indices, the routing weights and the gate/up projection
(S, 2I) of the S assignments. The sorted copy of the tokens, the activation, its product with ``up``, the expert
outputs and their weighted copies are not kept (autograd of the plain form keeps all of them: about three times
the memory); the backward gathers and recomputes them (elementwise, no extra GEMM). The routing weights' gradient
comes from the recomputed activation, ``dL/dw_a = <dL/dy_t @ down_e, h_a>``, so the expert outputs are never needed.

Engines (``backend``):

- ``loop``: one matmul per expert per product, on each expert's rows only, writing into preallocated outputs; the
  gathers and temporaries are one expert's rows at a time, so the backward's extra memory is one expert's share.
  An expert without tokens still gets a zero gradient (not None), as in a one-device run.
- ``grouped_mm``: the same function on whole tensors with ``torch._grouped_mm`` (no padding, no per-expert
  launches: the GPU form). Only some builds and devices run it, so ``auto`` tries it once per device and dtype on
  a tiny problem, forward and backward against the loop, and uses it only where it works and agrees, on GPUs. On
  CPU ``auto`` is the loop: torch's CPU grouped GEMM is a loop of matmuls itself and its whole-tensor temporaries
  cost memory the loop does not.
- ``bmm``: each expert's rows padded to the busiest expert's count, one batched matmul, through plain autograd
  (memory grows with the imbalance; a reference form).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXPERT_BACKENDS", "GroupedExperts", "grouped_mm_works", "grouped_swiglu", "routed_swiglu"]

EXPERT_BACKENDS = ("auto", "grouped_mm", "bmm", "loop")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _wide(dtype: torch.dtype) -> torch.dtype:
    # Sums over assignments run in at least fp32, as torch's own bf16 reductions do.
    return torch.promote_types(dtype, torch.float32)


def _chunks(counts: torch.Tensor, rows: int, per_expert: bool) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each chunk of consecutive experts the engine computes at
    once: one per expert that has rows, or one of every expert without reading the counts (no host sync)."""
    if not per_expert:
        return [(0, counts.numel(), 0, rows)] if rows else []
    chunks, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n < 0:  # a negative count can still add up to the rows, and the experts' runs would overlap
            raise ValueError(f"grouped experts: expert {e} has a negative count ({n}) of assignments")
        if n:
            chunks.append((e, e + 1, start, start + n))
            start += n
    return chunks


def _rows(x: torch.Tensor, token: torch.Tensor | None, s: int, t: int) -> torch.Tensor:
    return x[s:t] if token is None else x.index_select(0, token[s:t])


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``a`` in groups (``offs``: the groups' end rows) times their group's matrix of ``w`` (G, K, M)."""
    return torch.mm(a, w[0]) if w.shape[0] == 1 else torch._grouped_mm(a, w, offs=offs)


def _mm_t(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Per group g of rows: ``a_g^T @ b_g`` -> (G, K, M); an empty group gives zeros."""
    return torch.mm(a.t(), b).unsqueeze(0) if groups == 1 else torch._grouped_mm(a.t(), b, offs=offs)


class _Experts(torch.autograd.Function):
    """The SwiGLU experts over sorted assignments, optionally gathered from ``x`` by ``token``, weighted and summed
    back per token (see the module docstring); the backward recomputes instead of keeping activations.

    The work runs in chunks of consecutive experts (:func:`_chunks`): a chunk of one expert uses ``torch.mm``, a wider
    one ``torch._grouped_mm``; gathers and temporaries are one chunk's rows at a time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None,
                token: torch.Tensor | None, counts: torch.Tensor, per_expert: bool) -> torch.Tensor:
        rows = x.shape[0] if token is None else token.shape[0]
        chunks = _chunks(counts, rows, per_expert)
        if per_expert and (chunks[-1][3] if chunks else 0) != rows:
            raise ValueError(f"grouped experts: the counts add up to {chunks[-1][3] if chunks else 0} assignments "
                             f"for {rows} rows")
        acc = _wide(x.dtype) if x.dtype in _LOW_PRECISION else x.dtype
        if token is None:
            y = x.new_empty(rows, down.shape[1])
        else:
            y = torch.zeros(x.shape[0], down.shape[1], dtype=acc, device=x.device)
        ends = torch.cumsum(counts, 0)
        gus = []
        for lo, hi, s, t in chunks:
            offs = None if hi - lo == 1 else (ends[lo:hi] - s).to(torch.int32)
            gu = _mm(_rows(x, token, s, t), gate_up[lo:hi].transpose(-2, -1), offs)
            gus.append(gu)
            out = _mm(_swiglu(gu), down[lo:hi].transpose(-2, -1), offs)
            if weights is not None:
                out.mul_(weights[s:t].unsqueeze(-1))
            if token is None:
                y[s:t] = out
            else:
                y.index_add_(0, token[s:t], out.to(acc))
        ctx.save_for_backward(x, gate_up, down, weights, token, ends, *gus)
        ctx.chunks = chunks
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate_up, down, weights, token, ends, *gus = ctx.saved_tensors
        need_x, need_gu, need_dn, need_w = ctx.needs_input_grad[:4]
        grad = grad.contiguous()
        acc = _wide(x.dtype) if x.dtype in _LOW_PRECISION else x.dtype
        gx = torch.zeros(x.shape, dtype=acc if token is not None else x.dtype, device=x.device) if need_x else None
        g_gu = torch.zeros_like(gate_up) if need_gu else None
        g_dn = torch.zeros_like(down) if need_dn else None
        g_w = torch.zeros_like(weights) if need_w else None
        inter = down.shape[2]
        for (lo, hi, s, t), gu in zip(ctx.chunks, gus):
            groups = hi - lo
            offs = None if groups == 1 else (ends[lo:hi] - s).to(torch.int32)
            rows = _rows(grad, token, s, t)
            gate, up = gu[:, :inter], gu[:, inter:]
            act = F.silu(gate)
            h = act * up
            dh = _mm(rows, down[lo:hi], offs)  # dL/dh before the routing weight
            if weights is not None:
                w = weights[s:t].unsqueeze(-1)
                if need_w:
                    g_w[s:t] = torch.linalg.vecdot(dh, h)  # dL/dw = <dL/dout, out> = <dL/dout @ down, h>
                dh.mul_(w)
                rows = rows * w
            if need_dn:
                g_dn[lo:hi] = _mm_t(rows, h, offs, groups)
            del h, rows
            if not (need_x or need_gu):
                continue
            d_gu = torch.empty_like(gu)
            torch.mul(dh, act, out=d_gu[:, inter:])
            del act
            torch.ops.aten.silu_backward.grad_input(dh.mul_(up), gate, grad_input=d_gu[:, :inter])
            del dh
            if need_gu:
                g_gu[lo:hi] = _mm_t(d_gu, _rows(x, token, s, t), offs, groups)
            if need_x:
                gxs = _mm(d_gu, gate_up[lo:hi], offs)
                if token is None:
                    gx[s:t] = gxs
                else:
                    gx.index_add_(0, token[s:t], gxs.to(acc))
        if gx is not None:
            gx = gx.to(x.dtype)
        return gx, g_gu, g_dn, g_w, None, None, None


def _bmm(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    experts = counts.numel()
    if tokens.shape[0] == 0:
        return tokens.new_zeros(0, down.shape[1]) + 0 * (gate_up.sum() + down.sum())
    owner = torch.repeat_interleave(torch.arange(experts, device=tokens.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(tokens.shape[0], device=tokens.device) - starts[owner]
    padded = tokens.new_zeros(experts, int(counts.max()), tokens.shape[1])
    padded = padded.index_put((owner, slot), tokens)
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))
    return out[owner, slot]


def _probe_problem(device_type: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g).to(device_type, dtype).requires_grad_()
    gate_up = torch.randn(5, 32, 16, generator=g).to(device_type, dtype).requires_grad_()
    down = torch.randn(5, 16, 16, generator=g).to(device_type, dtype).requires_grad_()
    weights = torch.rand(24, generator=g).to(device_type, dtype).requires_grad_()
    token = torch.randperm(24, generator=g).to(device_type) % 12
    counts = torch.tensor([8, 8, 4, 0, 4], device=device_type)  # an empty expert
    return x, gate_up, down, weights, token, counts


@functools.lru_cache(maxsize=None)
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (its 3-D and 2-D forms, as the engine uses them) runs forward and backward on
    this device type and dtype and agrees with the per-expert loop, on a tiny problem with an empty expert (tried once
    per device type and dtype)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        problem = _probe_problem(device_type, dtype)
        results = []
        for per_expert in (True, False):
            out = _Experts.apply(*problem, per_expert)
            results.append((out.detach(), *torch.autograd.grad(out.float().square().sum(), problem[:4])))
        tol = 2e-2 if dtype.itemsize < 4 else 1e-4
        return all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, float(b.float().abs().max())))
                   for a, b in zip(*results))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned rows.
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def _per_expert(backend: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``backend`` runs one matmul per expert (else one grouped GEMM of every expert)."""
    if backend == "loop":
        return True
    usable = grouped_mm_works(x.device.type, x.dtype) and _aligned(x, gate_up, down)
    if backend == "grouped_mm" and not usable:
        raise RuntimeError(f"experts_backend='grouped_mm': torch._grouped_mm does not run (forward and backward) on "
                           f"{x.device.type} with {x.dtype} and these shapes in this torch build; use "
                           "experts_backend='auto' (falls back to a loop), 'bmm' or 'loop'")
    # On CPU, auto is the loop (see the module docstring).
    return not usable or (backend == "auto" and x.device.type == "cpu")


def _check_backend(backend: str) -> None:
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"experts backend {backend!r} is not one of {EXPERT_BACKENDS}")


def grouped_swiglu(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """SwiGLU of each expert over its run of ``tokens`` (sorted by expert; ``counts[e]`` rows for expert e), in the
    same order.

    Raises:
        RuntimeError: ``backend="grouped_mm"`` where it does not work (the message names the fallbacks).
        ValueError: ``counts`` that do not add up to the rows of ``tokens``; an unknown backend.
    """
    _check_backend(backend)
    if backend == "bmm":
        return _bmm(tokens, counts, gate_up, down)
    return _Experts.apply(tokens, gate_up, down, None, None, counts, _per_expert(backend, tokens, gate_up, down))


def routed_swiglu(x: torch.Tensor, token: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The routed experts' weighted sum per token: row ``t`` of the result is ``sum_a weights[a] *
    SwiGLU_{e(a)}(x[t])`` over the assignments ``a`` with ``token[a] == t``; the assignments are sorted by expert,
    ``counts[e]`` of them for expert e. Sums over assignments run in at least fp32.

    Args:
        x: (N, H) tokens. token: (S,) the token of each assignment. weights: (S,) routing weights (cast to ``x``'s
            dtype). counts: (E,) assignments per expert. gate_up, down: the stacked weights, ``x``'s dtype.

    Raises:
        RuntimeError / ValueError: as :func:`grouped_swiglu`.
    """
    _check_backend(backend)
    weights = weights.to(x.dtype)
    if backend == "bmm":
        out = _bmm(x[token], counts, gate_up, down) * weights.unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, out)
    return _Experts.apply(x, gate_up, down, weights, token, counts, _per_expert(backend, x, gate_up, down))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts; ``forward(tokens, counts)``: tokens sorted by expert, ``counts`` per expert;
    :meth:`routed`: the whole routed sum from unsorted tokens (:func:`routed_swiglu`).

    Expert parallelism sets :attr:`weight_view` to the function that gives this rank's part of a (sharded) stacked
    weight; ``counts`` then has one entry per local expert.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str = "auto"):
        super().__init__()
        self.num_experts = num_experts
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.weight_view: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        view: Any = self.weight_view
        if view is None:
            return self.gate_up_proj, self.down_proj
        return view(self.gate_up_proj), view(self.down_proj)

    def _weights_for(self, counts: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = self.local_weights()
        if counts.numel() != gate_up.shape[0]:
            raise ValueError(f"GroupedExperts: {counts.numel()} token counts for {gate_up.shape[0]} experts")
        return gate_up.to(dtype), down.to(dtype)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._weights_for(counts, tokens.dtype)
        return grouped_swiglu(tokens, counts, gate_up, down, self.backend)

    def routed(self, x: torch.Tensor, token: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert local: the weighted sum per token of ``x`` (N, H) over its assignments (sorted by expert)."""
        gate_up, down = self._weights_for(counts, x.dtype)
        return routed_swiglu(x, token, weights, counts, gate_up, down, self.backend)
