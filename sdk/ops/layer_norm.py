"""LayerNorm: reference (fallback + test oracle), dispatch, autograd and torch.library registration.

``y = (x - mean) * rstd * weight + bias`` over the last dim with fp32 statistics whatever the input dtype;
only mean and rstd (two fp32 per row) are saved besides x and the weight. Backends: reference and Triton (the
CPU default is the reference: torch's own layer_norm kernel, already fused, is what it runs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import OpSpec, direct_call_ok, register

__all__ = ["SPEC", "layer_norm", "layer_norm_reference"]


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Plain-PyTorch LayerNorm in fp32 (fp64 for fp64 inputs), cast back to ``x``'s dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    b = None if bias is None else bias.to(acc)
    return F.layer_norm(x.to(acc), x.shape[-1:], weight.to(acc), b, eps).to(x.dtype)


def _acc(x: Tensor) -> torch.dtype:
    """The statistics' and the reference's compute dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reference_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    xf = x.to(_acc(x))
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (xf - mean) * rstd * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype).contiguous(), mean.squeeze(-1), rstd.squeeze(-1)


def _reference_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    acc = _acc(x)
    xf, dyf, r = x.to(acc), dy.to(acc), rstd.to(acc).unsqueeze(-1)
    xhat = (xf - mean.to(acc).unsqueeze(-1)) * r
    g = dyf * weight.to(acc)
    dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    db = dyf.reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype).contiguous(), dw.to(weight.dtype), db.to(weight.dtype)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _backend(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: str) -> str:
    # the Triton kernels take one storage dtype; mixed dtypes and float64 go through the reference
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype) or x.dtype == torch.float64:
        return "reference"
    return SPEC.select(kernel, x.device)


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    b = None if bias is None else bias.contiguous()
    backend = _backend(x, weight, bias, "layer_norm_fwd")
    y, mean, rstd = SPEC.call("layer_norm_fwd", backend, _rows(x), weight.contiguous(), b, eps)
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@torch.library.custom_op("shardkit::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stat = x.new_empty(x.shape[:-1], dtype=_acc(x))
    return x.new_empty(x.shape), stat, stat.clone()


@torch.library.custom_op("shardkit::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                            rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    backend = _backend(x, weight, None, "layer_norm_bwd")
    dx, dw, db = SPEC.call("layer_norm_bwd", backend, _rows(dy), _rows(x), weight.contiguous(),
                           mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous())
    return dx.view(x.shape), dw, db


@_layer_norm_backward_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _eps = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.has_bias = bias is not None


def _backward(ctx, dy: Tensor, _dmean: Tensor, _drstd: Tensor):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward_op(dy, x, weight, mean, rstd)
    return dx, dw, (db if ctx.has_bias else None), None


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Fused LayerNorm over the last dim of ``x`` on the best backend for its device.

    Args:
        x: input of shape (..., hidden).
        weight: scale of shape (hidden,).
        bias: shift of shape (hidden,), or None.
        eps: added to the variance before the reciprocal square root.

    Returns:
        Tensor like ``x``.

    Raises:
        ValueError: ``weight`` or ``bias`` is not one entry per feature of ``x``'s last dim.
    """
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or x.dim() == 0 or x.shape[-1] != t.shape[0]):
            raise ValueError(f"layer_norm: {name} of shape {tuple(t.shape)} does not match x of shape "
                             f"{tuple(x.shape)}; it needs one entry per feature of x's last dim")
    op = _forward if direct_call_ok(x, weight, bias) else _layer_norm_op
    return op(x, weight, bias, float(eps))[0]


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    rows, n = (4096, 4096) if size == "bench" else (5, 123)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(n, generator=gen).to(device, dtype).requires_grad_()
    b = torch.randn(n, generator=gen).to(device, dtype).requires_grad_()
    return x, w, b


SPEC = register(OpSpec(
    name="layer_norm", function=layer_norm, reference=layer_norm_reference, csrc=None,
    kernels={"layer_norm_fwd": {"reference": _reference_fwd,
                                "triton": "shardkit.kernels.layer_norm:layer_norm_fwd"},
             "layer_norm_bwd": {"reference": _reference_bwd,
                                "triton": "shardkit.kernels.layer_norm:layer_norm_bwd"}},
    triton_checks="shardkit.kernels.layer_norm:compile_checks", example=_example))
