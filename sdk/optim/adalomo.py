"""AdaLomo on any device: lomo-optim's update rule, with its state on each parameter's own device.

lomo-optim 0.1.1's ``AdaLomo`` creates its state with ``.cuda()`` at construction, so it cannot run on a
CPU. This is the same update (the package's ``fuse_update``, transcribed op for op so the results agree
bitwise on the same inputs; ``tests/unit/test_backward_step_optimizers.py`` checks it against the
package's own code), driven the same way::

    optimizer = AdaLomo(model.parameters(), lr=1e-3)
    optimizer.fused_backward(loss, lr)          # the parameters are updated during this backward

Differences from the package, all outside the update rule:

- each parameter is updated from its own ``register_post_accumulate_grad_hook`` (the package loops over
  every parameter from every gradient hook and needs a last call after backward);
- the state lives in ``self.state[p]`` (fp32, on the parameter's device) and the step count in every
  param group, so ``state_dict()`` saves and restores it exactly;
- weight decay is read per param group (the package has one value for all parameters);
- ``grad_reducer`` (set by the Trainer under DDP) averages each gradient across ranks before it is used;
  no DeepSpeed ZeRO-3 path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["AdaLomo"]


class AdaLomo(Optimizer):
    """Adaptive LOMO (Lv et al. 2023): Adafactor-style factored second moments, applied inside backward.

    Args:
        params: parameters or param groups (each group may set ``lr`` and ``weight_decay``).
        lr: learning rate; :meth:`fused_backward` may pass the step's rate (the scheduler's).
        loss_scale: the loss is multiplied by it before backward and the gradients divided after (the
            package's default, 2**10, keeps small fp32 gradients away from underflow in half types).
        eps: (added to squared gradients, floor of the parameter RMS that scales the step).
        clip_threshold: the update's RMS is clipped to this.
        decay_rate: exponent of the second-moment decay, ``beta2_t = 1 - t**decay_rate``.
        clip_grad_norm: clip the total gradient norm to this; needs :meth:`grad_norm` before each
            :meth:`fused_backward` (one extra backward).
        clip_grad_value: clamp each gradient element to +-this.
        weight_decay: decoupled weight decay, scaled by the step size.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, loss_scale: float = 2**10,
                 eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0, decay_rate: float = -0.8,
                 clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 weight_decay: float = 0.0):
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ValueError(f"AdaLomo clip_grad_norm={clip_grad_norm} must be positive (or None for no clipping)")
        if lr < 0:
            raise ValueError(f"AdaLomo lr={lr} must be >= 0")
        defaults = dict(lr=lr, weight_decay=weight_decay, step=0)
        super().__init__(params, defaults)
        self.loss_scale = loss_scale
        self.eps = tuple(eps)
        self.clip_threshold = clip_threshold
        self.decay_rate = decay_rate
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.clip_coef: torch.Tensor | None = None
        self._gather_norm = False
        self._norms: list[torch.Tensor] = []
        # Set by a data-parallel driver: averages a gradient across ranks in place, before it is used.
        self.grad_reducer: Callable[[torch.Tensor], None] | None = None
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._handles = []
        for group in self.param_groups:
            for p in group["params"]:
                self._group_of[p] = group
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---- driving it ----------------------------------------------------------------------------

    def fused_backward(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Backward of ``loss``; every parameter is updated as soon as its gradient is complete.

        Args:
            loss: the loss of this step.
            lr: this step's learning rate for every group (the package's API); None keeps each group's.
        """
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = lr
        if self.clip_grad_norm is not None and self.clip_coef is None:
            raise ValueError("AdaLomo(clip_grad_norm=...) needs optimizer.grad_norm(loss) before each "
                             "fused_backward(loss, lr)")
        for group in self.param_groups:
            group["step"] += 1
        (loss * self.loss_scale if self.loss_scale else loss).backward()

    def grad_norm(self, loss: torch.Tensor) -> torch.Tensor:
        """A first backward (graph kept) that only measures the total gradient norm, for clipping.

        Returns:
            the total 2-norm of the gradients (unscaled).
        """
        self._gather_norm, self._norms = True, []
        try:
            (loss * self.loss_scale if self.loss_scale else loss).backward(retain_graph=True)
        finally:
            self._gather_norm = False
        with torch.no_grad():
            total = torch.norm(torch.stack(self._norms), 2.0)
            self.clip_coef = torch.clamp(float(self.clip_grad_norm or math.inf) / (total + 1e-6), max=1.0)
        self._norms = []
        return total

    def step(self, closure: Any = None) -> Any:
        """Nothing to do: the update ran inside :meth:`fused_backward`. Returns the closure's loss, if any."""
        return closure() if closure is not None else None

    # ---- the update (the package's fuse_update for one parameter) -------------------------------

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if self.grad_reducer is not None:
            self.grad_reducer(p.grad)
        grad_fp32 = p.grad.to(torch.float32)
        p.grad = None
        if self.loss_scale:
            grad_fp32.div_(self.loss_scale)
        if self._gather_norm:
            self._norms.append(torch.norm(grad_fp32, 2.0))
            return
        if self.clip_grad_value is not None and self.clip_grad_value > 0:
            grad_fp32.clamp_(min=-self.clip_grad_value, max=self.clip_grad_value)
        if self.clip_grad_norm is not None and self.clip_grad_norm > 0 and self.clip_coef is not None:
            grad_fp32.mul_(self.clip_coef)
        group = self._group_of[p]
        update = self._scaled_update(p, grad_fp32, group["step"])
        p_fp32 = p.data.to(torch.float32)
        p_rms = torch.norm(p_fp32, 2.0) / math.sqrt(p.numel())
        lr = group["lr"] * max(self.eps[1], p_rms)
        if group["weight_decay"] > 0.0:
            p_fp32.mul_(1.0 - lr * group["weight_decay"])
        p_fp32.add_(update, alpha=-lr)
        p.data.copy_(p_fp32)

    def _scaled_update(self, p: torch.Tensor, grad_fp32: torch.Tensor, step: int) -> torch.Tensor:
        decay_rate = -self.decay_rate if step == 0 and self.decay_rate < 0 else self.decay_rate
        beta2t = 1.0 - math.pow(step, decay_rate)
        update = (grad_fp32**2) + self.eps[0]
        state = self._state_for(p)
        if p.dim() > 1:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
            update = _approx_sq_grad(row, col)
            update.mul_(grad_fp32)
        else:
            state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            update = state["exp_avg_sq"].rsqrt().mul_(grad_fp32)
        update.div_((_rms(update) / self.clip_threshold).clamp_(min=1.0))
        return update

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            # The package's shapes: rows and columns of the last two dims, or the whole 1-d vector.
            zeros = dict(dtype=torch.float32, device=p.device)
            if p.dim() > 1:
                state["exp_avg_sq_row"] = torch.zeros(p.shape[0], **zeros)
                state["exp_avg_sq_col"] = torch.zeros(p.shape[1], **zeros)
            else:
                state["exp_avg_sq"] = torch.zeros(p.shape[0], **zeros)
        return state

    # ---- saving ---------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state and groups; the fp32 moments stay fp32 whatever the parameters' dtype (torch's
        loader would cast them to a bf16 parameter's dtype and the resumed run would drift)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, index in zip(params, saved_ids):
            for key, value in state_dict["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32).clone()
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}


def _approx_sq_grad(exp_avg_sq_row: torch.Tensor, exp_avg_sq_col: torch.Tensor) -> torch.Tensor:
    # The factored second moment's inverse square root (Adafactor's; the package's _approx_sq_grad).
    r_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor)


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.norm(2) / (tensor.numel() ** 0.5)
