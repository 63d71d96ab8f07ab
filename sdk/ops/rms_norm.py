"""RMSNorm: reference (fallback + test oracle), dispatch, autograd and torch.library registration.

``y = x * rstd * (weight + offset)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` over the last dim, accumulated
in fp32 whatever the input dtype; ``offset=1.0`` is Gemma's ``(1 + weight)``. Only ``rstd`` (one fp32 per
row) is saved for backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .registry import OpSpec, direct_call_ok, native, register

__all__ = ["SPEC", "rms_norm", "rms_norm_reference"]


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """Plain-PyTorch RMSNorm (differentiable by autograd): the oracle the fused backends are tested against."""
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * (weight.to(xf.dtype) + offset)).to(x.dtype)


def _reference_fwd(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * (weight.to(xf.dtype) + offset)).to(x.dtype).contiguous()
    return y, rstd.squeeze(-1).float()


def _reference_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, dyf, r = x.to(acc), dy.to(acc), rstd.to(acc).unsqueeze(-1)
    xhat = xf * r
    g = dyf * (weight.to(acc) + offset)
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype).contiguous(), dw.to(weight.dtype)


def _rows(t: Tensor) -> Tensor:
    """``t`` as contiguous (rows, n) rows of its last dim: the layout every backend of the table takes."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _backend(x: Tensor, weight: Tensor, kernel: str) -> str:
    # NOTE: the native kernels take one storage dtype; mixed x/weight dtypes (fp32 weight, bf16 activations)
    # and float64 go through the reference, which upcasts.
    if x.dtype != weight.dtype or x.dtype == torch.float64:
        return "reference"
    return SPEC.select(kernel, x.device)


def _forward(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    backend = _backend(x, weight, "rms_norm_fwd")
    y, rstd = SPEC.call("rms_norm_fwd", backend, _rows(x), weight.contiguous(), eps, offset)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@torch.library.custom_op("shardkit::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return _forward(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("shardkit::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    backend = _backend(x, weight, "rms_norm_bwd")
    dx, dw = SPEC.call("rms_norm_bwd", backend, _rows(dy), _rows(x), weight.contiguous(), rstd.reshape(-1).contiguous(),
                       offset)
    return dx.view(x.shape), dw


@_rms_norm_backward_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy: Tensor, _drstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, rstd, ctx.offset)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """Fused RMSNorm over the last dim of ``x`` on the best backend for its device.

    Args:
        x: input of shape (..., hidden).
        weight: scale of shape (hidden,).
        eps: added to the mean square before the reciprocal square root.
        offset: added to ``weight``; 1.0 gives Gemma's ``(1 + weight)``.

    Returns:
        Tensor like ``x``.

    Raises:
        ValueError: ``weight`` is not one entry per feature of ``x``'s last dim.
    """
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match x of shape {tuple(x.shape)}; "
                         "the weight needs one entry per feature of x's last dim")
    op = _forward if direct_call_ok(x, weight) else _rms_norm_op
    return op(x, weight, float(eps), float(offset))[0]


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    rows, n = (4096, 4096) if size == "bench" else (5, 123)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(n, generator=gen).to(device, dtype).requires_grad_()
    return x, w


SPEC = register(OpSpec(
    name="rms_norm", function=rms_norm, reference=rms_norm_reference, csrc="rms_norm",
    kernels={"rms_norm_fwd": {"reference": _reference_fwd, "triton": "shardkit.kernels.rms_norm:rms_norm_fwd",
                              **native("rms_norm_fwd")},
             "rms_norm_bwd": {"reference": _reference_bwd, "triton": "shardkit.kernels.rms_norm:rms_norm_bwd",
                              **native("rms_norm_bwd")}},
    triton_checks="shardkit.kernels.rms_norm:compile_checks", example=_example))
