"""Gated linear units ``act(gate) * up`` (SwiGLU, GeGLU): the custom ops, autograd and backend tables both share.

Backward saves only ``gate`` and ``up`` (which the surrounding linear layers produce and nothing else keeps) and
recomputes the activation: nothing of the size of the product is stored, e.g. 4 x 2048 x 11008 x 2 B = 180 MB per
layer in bf16 not kept for a 7B Llama MLP. With ``in_place_backward=True`` the backward also writes d gate over
``gate`` and d up over ``up`` (Liger-Kernel's memory: no (tokens, intermediate) buffer allocated in backward,
where the out-of-place form allocates two). That destroys the two activations, so it is taken only where they
are intermediates of the graph (not leaves nor views of leaves), contiguous, distinct and plain tensors in eager
mode; the MLP modules (``SwiGLUMLP``, ``GeGLUMLP``, the Hugging Face patch) pass it because their gate and up are fresh
linear outputs nothing else reads. Under torch.compile the out-of-place backward is traced (the compiler plans
its own buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .registry import OpSpec, direct_call_ok, native

__all__ = ["GluOp", "acc_dtype", "build_glu", "can_overwrite", "can_take_grads_in_place", "glu_example", "plain_eager"]

BwdFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def plain_eager(*tensors: Tensor) -> bool:
    """Eager mode on plain tensors: nothing traces (dynamo, a dispatch mode) and no tensor subclass."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _disjoint(a: Tensor, b: Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    nbytes = a.numel() * a.element_size()
    return a0 + nbytes <= b0 or b0 + nbytes <= a0


def can_overwrite(t: Tensor) -> bool:
    """Whether ``t`` is an intermediate an op may write its gradient over: a contiguous, non-empty plain tensor
    in eager mode that requires grad and is neither a leaf (a user's tensor, a parameter) nor a view of one
    (``leaf.view(...)`` has a ``grad_fn`` but shares the leaf's storage)."""
    if not (plain_eager(t) and t.requires_grad and t.grad_fn is not None):
        return False
    base = t._base
    return (base is None or base.grad_fn is not None) and t.is_contiguous() and t.numel() > 0


def can_take_grads_in_place(gate: Tensor, up: Tensor) -> bool:
    """Whether the backward may overwrite ``gate`` and ``up`` with their gradients (see the module docstring)."""
    if not (gate.shape == up.shape and gate.dtype == up.dtype):
        return False
    return can_overwrite(gate) and can_overwrite(up) and _disjoint(gate, up)


@dataclass
class GluOp:
    """One gated op: its public function, custom op and backend tables (the op module registers the spec).

    ``function`` calls ``self.op`` (looked up per call, so a test can wrap it) unless it may skip it.
    """

    name: str
    op: Callable[..., Tensor]
    forward: Callable[[Tensor, Tensor], Tensor]
    kernels: dict[str, dict[str, Any]]

    def function(self, gate: Tensor, up: Tensor, *, in_place_backward: bool = False) -> Tensor:
        """``act(gate) * up``: the implementation directly (eager, no gradient wanted) or the custom op."""
        if direct_call_ok(gate, up):
            return self.forward(gate, up)
        return self.op(gate, up, in_place_backward)


def build_glu(name: str, gelu: bool, reference: Callable[[Tensor, Tensor], Tensor], reference_bwd: BwdFn,
              spec: Callable[[], OpSpec]) -> GluOp:
    """Build the custom ops of ``act(gate) * up``; ``gelu`` picks the Triton/native activation (else silu).

    ``spec()`` returns the op's registered spec (the op module's ``SPEC``, read at call time).
    """
    fwd, bwd, bwd_ip = f"{name}_fwd", f"{name}_bwd", f"{name}_bwd_inplace"

    def backend(gate: Tensor, up: Tensor, kernel: str) -> str:
        if gate.dtype != up.dtype or gate.dtype == torch.float64 or gate.shape != up.shape:
            return "reference"
        return spec().select(kernel, gate.device)

    def forward(gate: Tensor, up: Tensor) -> Tensor:
        return spec().call(fwd, backend(gate, up, fwd), gate, up)

    @torch.library.custom_op(f"shardkit::{name}", mutates_args=())
    def op(gate: Tensor, up: Tensor, in_place_backward: bool) -> Tensor:
        return forward(gate, up)

    @op.register_fake
    def _(gate: Tensor, up: Tensor, in_place_backward: bool) -> Tensor:
        return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape))

    @torch.library.custom_op(f"shardkit::{name}_backward", mutates_args=())
    def backward_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        return spec().call(bwd, backend(gate, up, bwd), dy, gate, up)

    @backward_op.register_fake
    def _(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        return gate.new_empty(dy.shape), up.new_empty(dy.shape)

    @torch.library.custom_op(f"shardkit::{name}_backward_", mutates_args=("gate", "up"))
    def backward_inplace_op(dy: Tensor, gate: Tensor, up: Tensor) -> None:
        spec().call(bwd_ip, backend(gate, up, bwd_ip), dy.contiguous(), gate, up)

    def setup_context(ctx, inputs, output) -> None:
        gate, up, in_place = inputs
        ctx.save_for_backward(gate, up)
        ctx.in_place = bool(in_place) and can_take_grads_in_place(gate, up)

    def backward(ctx, dy: Tensor):
        gate, up = ctx.saved_tensors
        if ctx.in_place and plain_eager(dy, gate, up) and dy.shape == gate.shape:
            backward_inplace_op(dy, gate, up)
            return gate, up, None
        dg, du = backward_op(dy, gate, up)
        # reference path with broadcasting: reduce back to each input's shape
        return dg.sum_to_size(gate.shape), du.sum_to_size(up.shape), None

    op.register_autograd(backward, setup_context=setup_context)

    def reference_fwd(gate: Tensor, up: Tensor) -> Tensor:
        return reference(gate, up).contiguous()

    def reference_bwd_contiguous(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        dg, du = reference_bwd(dy, gate, up)
        return dg.contiguous(), du.contiguous()

    def reference_bwd_inplace(dy: Tensor, gate: Tensor, up: Tensor) -> None:
        dg, du = reference_bwd(dy, gate, up)
        gate.copy_(dg)
        up.copy_(du)

    def triton_fwd(gate: Tensor, up: Tensor) -> Tensor:
        from shardkit.kernels import swiglu as tk

        return tk.glu_fwd(gate.contiguous(), up.contiguous(), gelu)

    def triton_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        from shardkit.kernels import swiglu as tk

        return tk.glu_bwd(dy.contiguous(), gate.contiguous(), up.contiguous(), gelu)

    def triton_bwd_inplace(dy: Tensor, gate: Tensor, up: Tensor) -> None:
        from shardkit.kernels import swiglu as tk

        tk.glu_bwd_inplace(dy, gate, up, gelu)

    def native_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> Any:
        return getattr(torch.ops.shardkit_C, bwd)(dy.to(gate.dtype), gate, up)  # the kernel takes one dtype

    def native_bwd_inplace(dy: Tensor, gate: Tensor, up: Tensor) -> None:
        getattr(torch.ops.shardkit_C, bwd_ip)(dy.to(gate.dtype), gate, up)

    kernels = {
        fwd: {"reference": reference_fwd, "triton": triton_fwd, **native(fwd)},
        bwd: {"reference": reference_bwd_contiguous, "triton": triton_bwd, "cpp": native_bwd, "cuda": native_bwd},
        bwd_ip: {"reference": reference_bwd_inplace, "triton": triton_bwd_inplace, "cpp": native_bwd_inplace,
                 "cuda": native_bwd_inplace},
    }
    return GluOp(name, op, forward, kernels)


def glu_example(device: str, dtype: torch.dtype, size: str) -> tuple:
    """``(gate, up)`` leaves: (5, 123) for tests, a 7B Llama MLP's (4096, 11008) for the benchmark."""
    m, f = (4096, 11008) if size == "bench" else (5, 123)
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(m, f, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))


def acc_dtype(t: Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the references' compute dtype."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
