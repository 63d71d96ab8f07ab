"""FusedAdamW: AdamW with one fused pass per tensor, fp32 states and fp32 master weights for 16-bit params.

Backends (``shardkit.ops.select_backend``): ``cpp`` on CPU (``shardkit_C::adamw_step_``: OpenMP over 64 Ki-element
chunks of every tensor at once, 28 bytes/param in fp32: the optimizer of ZeRO CPU/NVMe offload), ``cuda`` on GPU
(the same op's CUDA kernel: multi-tensor launches of up to 24 tensors), ``triton`` on GPU (``shardkit.kernels.adamw``)
when the extension has no CUDA kernel, and ``reference`` (torch._foreach ops) everywhere else. The update is the
one of torch.optim.AdamW, in the same operation order:

    p = p * (1 - lr * weight_decay)
    m = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from shardkit.ops._dispatch import select_backend

__all__ = ["FusedAdamW", "adamw_step_reference"]

_SUPPORTED = ("reference", "cpp", "cuda", "triton")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_FP32_STATE = ("exp_avg", "exp_avg_sq", "master_param")


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


class FusedAdamW(Optimizer):
    """AdamW (decoupled weight decay, bias correction) with fused per-tensor kernels.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: learning rate (per group; schedulers may change it between steps).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay coefficient.
        amsgrad: not supported; True raises NotImplementedError.
        maximize: maximize the objective instead of minimizing.
        master_weights: keep an fp32 copy of every bf16/fp16 param in the state (``master_param``) and update
            that, rounding back to the param after each step. None (default) means True; False updates 16-bit
            params directly (in fp32 arithmetic, rounded every step).

    State per param: ``step`` (float32 scalar tensor, like torch), ``exp_avg`` and ``exp_avg_sq`` (fp32), and
    ``master_param`` (fp32) for 16-bit params with master weights. ``state_dict``/``load_state_dict`` use torch's
    machinery (checkpoints by parameter name work) and keep these states in fp32.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 master_weights: bool | None = None) -> None:
        if amsgrad:
            raise NotImplementedError("FusedAdamW does not implement amsgrad=True; use torch.optim.AdamW(params, "
                                      "amsgrad=True) (create_optimizer('adamw_torch', params, amsgrad=True))")
        if not 0.0 <= float(lr):
            raise ValueError(f"FusedAdamW: lr={lr} must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdamW: eps={eps} must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdamW: betas[{i}]={beta} must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdamW: weight_decay={weight_decay} must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, master_weights=master_weights)
        super().__init__(params, defaults)

    @staticmethod
    def _wants_master(p: Tensor, group: dict[str, Any]) -> bool:
        return p.dtype in _LOW_PRECISION and group.get("master_weights") is not False

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if self._wants_master(p, group) and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()
        return state

    def _apply(self, device: torch.device, args: tuple, hyper: tuple) -> None:
        params, grads = args[0], args[1]
        backend = select_backend("adamw_step_", device, _SUPPORTED) if _native_ok(params, grads) else "reference"
        if backend in ("cpp", "cuda"):  # one op, a CPU and a CUDA kernel
            torch.ops.shardkit_C.adamw_step_(*args, *hyper)
        elif backend == "triton":
            from shardkit.kernels import adamw as tk

            tk.adamw_step_(*args, *hyper)
        else:
            adamw_step_reference(*args, *hyper)

    @override
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (``closure`` re-evaluates the loss, as for any torch optimizer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            # batches keyed by (device, has master): one native call each
            batches: dict[tuple[torch.device, bool], tuple[list, ...]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients; use torch.optim.SparseAdam")
                state = self._init_state(p, group)
                state["step"] += 1
                step = float(state["step"])
                master = state.get("master_param")
                lists = batches.setdefault((p.device, master is not None), ([], [], [], [], [], [], []))
                lists[0].append(p)
                lists[1].append(p.grad.contiguous())
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
                if master is not None:
                    lists[4].append(master)
                lists[5].append(lr / (1.0 - beta1**step))
                lists[6].append(math.sqrt(1.0 - beta2**step))
            hyper = (lr, beta1, beta2, group["eps"], group["weight_decay"], group["maximize"])
            for (device, _), lists in batches.items():
                self._apply(device, lists, hyper)
        return loss

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, except that fp32 states stay fp32 (torch casts them to the param dtype)."""
        saved = {k: {n: v for n, v in s.items() if n in _FP32_STATE} for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for param_id, p in zip(ids, params):
            for key, value in saved.get(param_id, {}).items():
                if isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
