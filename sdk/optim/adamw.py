"""FusedAdamW: AdamW with one fused pass per tensor, fp32 states and fp32 master weights for 16-bit params.

The step itself is the fused op ``shardkit.ops.adamw.adamw_step`` (its backends and the update it computes are
described there); this module keeps the optimizer: param groups, state, master weights and batching per device.

DTensor parameters (FSDP2 shards, tensor-parallel weights) get DTensor states laid out like the parameter, so
sharded checkpoints save and reshard them as they do torch's AdamW states; the step runs on the local shards.
AdamW is elementwise, so updating each rank's shard alone is the whole update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from shardkit.ops.adamw import adamw_step, adamw_step_reference

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support: no DTensors can reach the optimizer
    DTensor = None

__all__ = ["FusedAdamW", "adamw_step_reference"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_FP32_STATE = ("exp_avg", "exp_avg_sq", "master_param")


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
            if key not in state:  # zeros_like: a DTensor parameter gets a DTensor state with its placements
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if self._wants_master(p, group) and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()
        return state

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
                lists[0].append(_local(p))
                lists[1].append(_local(_grad_like(p)).contiguous())
                lists[2].append(_local(state["exp_avg"]))
                lists[3].append(_local(state["exp_avg_sq"]))
                if master is not None:
                    lists[4].append(_local(master))
                lists[5].append(lr / (1.0 - beta1**step))
                lists[6].append(math.sqrt(1.0 - beta2**step))
            hyper = (lr, beta1, beta2, group["eps"], group["weight_decay"], group["maximize"])
            for lists in batches.values():
                adamw_step(*lists, *hyper)
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


def _local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: in-place updates reach the DTensor), else ``t``."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _grad_like(p: Tensor) -> Tensor:
    """``p.grad`` laid out as ``p``, so that their local shards cover the same elements.

    FSDP2 and tensor parallelism normally give a DTensor parameter a gradient with its own placements; one that
    differs (a partial sum, say) is redistributed here, a collective that every rank reaches in the same order.
    """
    grad = p.grad
    if DTensor is not None and isinstance(p, DTensor) and isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad
