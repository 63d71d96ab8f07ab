"""The fused AdamW step: reference (torch._foreach ops), dispatch to the cpp/cuda/triton kernels.

``shardkit.optim.FusedAdamW`` batches a param group's tensors per device and calls :func:`adamw_step` once per
batch. Backends: ``cpp`` on CPU (``shardkit_C::adamw_step_``: OpenMP over 64 Ki-element chunks of every tensor at
once, 28 bytes/param in fp32: the optimizer of ZeRO CPU/NVMe offload), ``cuda`` on GPU (the same op's CUDA kernel:
multi-tensor launches of up to 24 tensors), ``triton`` on GPU (``shardkit.kernels.adamw``: one launch over the whole
batch per dtype pair, from tables of the tensors' addresses and tiles) when the extension has no CUDA kernel or
``SHARDKIT_KERNEL_BACKEND=triton`` forces it, and ``reference`` everywhere else. The update is the one of
torch.optim.AdamW, in the same order:

    p = p * (1 - lr * weight_decay)
    m = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import OpSpec, native, register

__all__ = ["SPEC", "adamw_step", "adamw_step_reference"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def adamw_step_reference(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                         exp_avg_sqs: list[Tensor], masters: list[Tensor], step_sizes: list[float],
                         bc2_sqrts: list[float], lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, maximize: bool) -> None:
    """AdamW step with torch._foreach ops; same contract as ``torch.ops.shardkit_C.adamw_step_`` (in place).

    ``masters`` is empty (params are updated directly, in fp32 if they are 16-bit) or one fp32 copy per param.
    """
    g32 = [g.float() for g in grads]
    if maximize:
        g32 = torch._foreach_neg(g32)
    work = masters if masters else [p if p.dtype == torch.float32 else p.float() for p in params]
    torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g32, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrts)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, [-s for s in step_sizes])
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)  # round the fp32 result back to the param dtype


def _native_ok(params: list[Tensor], grads: list[Tensor]) -> bool:
    ok_dtypes = (torch.float32,) + _LOW_PRECISION
    return all(p.is_contiguous() and p.dtype in ok_dtypes and g.dtype in ok_dtypes for p, g in zip(params, grads))


def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               masters: list[Tensor], step_sizes: list[float], bc2_sqrts: list[float], lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, maximize: bool) -> None:
    """One AdamW step over tensors of one device, in place, on the best backend (arguments as the reference's).

    Contiguous float32/bfloat16/float16 tensors go to the fused kernels; anything else to the reference.
    """
    if not params:
        return
    backend = SPEC.select("adamw_step_", params[0].device) if _native_ok(params, grads) else "reference"
    SPEC.call("adamw_step_", backend, params, grads, exp_avgs, exp_avg_sqs, masters, step_sizes, bc2_sqrts, lr,
              beta1, beta2, eps, weight_decay, maximize)


SPEC = register(OpSpec(
    name="adamw", function=adamw_step, reference=adamw_step_reference, csrc="adamw",
    kernels={"adamw_step_": {"reference": adamw_step_reference, "triton": "shardkit.kernels.adamw:adamw_step_",
                             **native("adamw_step_")}},
    triton_checks="shardkit.kernels.adamw:compile_checks"))
