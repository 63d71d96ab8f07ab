"""SwiGLU experts held as stacked weights, computed over tokens sorted by expert in one grouped GEMM.

The weights use Hugging Face's layout (Qwen3-MoE, Mixtral in transformers 5), so they map one to one:
``gate_up_proj`` (E, 2 * I, H), the gate's rows first, and ``down_proj`` (E, H, I).

Backends, the same arithmetic each:

- ``grouped_mm``: ``torch._grouped_mm`` over the sorted tokens with the experts' offsets: no padding, no per-expert
  launches. Only some builds and devices run it (CUDA with bf16 on recent GPUs; this CPU build of torch runs the
  forward but not the backward), so ``auto`` tries it once per device and dtype on a tiny problem, forward and
  backward against the loop, and uses it only where both work and agree.
- ``bmm``: each expert's tokens padded to the busiest expert's count, one batched matmul (memory grows with the
  imbalance).
- ``loop``: one matmul per expert; an expert without tokens still takes part (zero rows), so its weights get a zero
  gradient rather than none, as in a one-device run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXPERT_BACKENDS", "GroupedExperts", "grouped_mm_works", "grouped_swiglu"]

EXPERT_BACKENDS = ("auto", "grouped_mm", "bmm", "loop")


def _loop(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    outs = []
    for e, chunk in enumerate(torch.split(tokens, counts.tolist())):
        gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs) if outs else tokens.new_zeros(0, down.shape[1])


def _bmm(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    experts = counts.numel()
    if tokens.shape[0] == 0:
        return _loop(tokens, counts, gate_up, down)
    owner = torch.repeat_interleave(torch.arange(experts, device=tokens.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(tokens.shape[0], device=tokens.device) - starts[owner]
    padded = tokens.new_zeros(experts, int(counts.max()), tokens.shape[1])
    padded = padded.index_put((owner, slot), tokens)
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))
    return out[owner, slot]


def _grouped(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)


@functools.lru_cache(maxsize=None)
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and dtype and agrees with the loop
    (tried once on a tiny problem with an empty expert)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randn(24, 16, generator=g).to(device_type, dtype)
        gate_up = torch.randn(3, 32, 16, generator=g).to(device_type, dtype).requires_grad_()
        down = torch.randn(3, 16, 16, generator=g).to(device_type, dtype).requires_grad_()
        counts = torch.tensor([8, 0, 16], device=device_type)
        out = _grouped(tokens, counts, gate_up, down)
        grad_gu, grad_dn = torch.autograd.grad(out.float().square().sum(), (gate_up, down))
        ref = _loop(tokens, counts, gate_up, down)
        ref_gu, ref_dn = torch.autograd.grad(ref.float().square().sum(), (gate_up, down))
        out, ref = out.detach(), ref.detach()
        tol = 2e-2 if dtype.itemsize < 4 else 1e-4
        return all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, float(b.float().abs().max())))
                   for a, b in ((out, ref), (grad_gu, ref_gu), (grad_dn, ref_dn)))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned rows.
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def grouped_swiglu(tokens: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """SwiGLU of each expert over its run of ``tokens`` (sorted by expert; ``counts[e]`` rows for expert e).

    Raises:
        RuntimeError: ``backend="grouped_mm"`` where it does not work (the message names the fallbacks).
    """
    if backend == "loop":
        return _loop(tokens, counts, gate_up, down)
    if backend == "bmm":
        return _bmm(tokens, counts, gate_up, down)
    usable = grouped_mm_works(tokens.device.type, tokens.dtype) and _aligned(tokens, gate_up, down)
    if backend == "grouped_mm" and not usable:
        raise RuntimeError(f"experts_backend='grouped_mm': torch._grouped_mm does not run (forward and backward) on "
                           f"{tokens.device.type} with {tokens.dtype} and these shapes in this torch build; use "
                           "experts_backend='auto' (falls back to a loop), 'bmm' or 'loop'")
    if usable and tokens.shape[0] > 0:
        return _grouped(tokens, counts, gate_up, down)
    return _loop(tokens, counts, gate_up, down)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts; ``forward(tokens, counts)``: tokens sorted by expert, ``counts`` per expert.

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

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.local_weights()
        if counts.numel() != gate_up.shape[0]:
            raise ValueError(f"GroupedExperts: {counts.numel()} token counts for {gate_up.shape[0]} experts")
        return grouped_swiglu(tokens, counts, gate_up.to(tokens.dtype), down.to(tokens.dtype), self.backend)
