"""A mixture-of-experts feed-forward layer: token-choice top-k routing over SwiGLU experts held as stacked weights.

    from shardkit.models.moe import MoE, MoEConfig
    layer = MoE(hidden_size=128, config=MoEConfig(num_experts=8, top_k=2, intermediate_size=64))
    y = layer(x)                      # (..., hidden): the routed experts' weighted sum, plus the shared experts
    layer.aux_loss                    # the load-balancing loss of the last training forward (already * coef)

Routing: the router's logits go through softmax or sigmoid (``score_func``) in at least fp32; each token picks
the ``top_k`` experts with the highest ``score + expert_bias`` (ties: the lower expert index, so that every
backend and device picks the same); its weights are the picked experts' scores, optionally normalised to sum
to one, times ``route_scale``. ``expert_bias`` is DeepSeek-V3's auxiliary-loss-free balancing: it only steers
the choice, and :func:`update_router_biases` moves it after each optimizer step by ``bias_update_rate`` towards
the experts that got fewer tokens than the mean.

Dropless by default: every assignment runs. The assignments are sorted by expert and computed by
:mod:`shardkit.models.moe_experts` (gather, SwiGLU, weighting and sum per token as one function). With
``capacity_factor`` each expert takes at most
``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments (in token order); the rest are dropped
(their token keeps its other experts and the residual) and counted in :attr:`MoE.dropped`.

Padding: ``forward(x, token_mask=...)`` (False at padding; shardkit's Llama passes its ``attention_mask``) drops the
masked tokens' assignments before dispatch. They take no capacity (``tokens`` above counts the real tokens, and the
real ones keep their token order), run no expert (their output is the shared experts' alone: finite, and never
attended) and are left out of every routing statistic (the load, the aux loss, the bias-update counts), so a
padded row routes as it would alone. Dropping rather than ranking them last keeps the capacity and the statistics a
function of the real tokens only, the same on every dispatcher (an expert-parallel rank sends nothing for them).

Strategies plug in through :attr:`MoE.dispatcher` (None: every expert is local, the statistics this process's):
expert parallelism installs one that sends each expert's tokens to the rank holding it and reduces the routing
statistics over the data-parallel ranks (``shardkit.strategies.expert_parallel``); context parallelism and pipelines
one that keeps the experts local and sums the statistics over the ranks holding the rest of the batch
(``shardkit.strategies.cp_moe``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.models.mlp import PlainSwiGLUMLP
from shardkit.models.moe_experts import EXPERT_BACKENDS, GroupedExperts
from shardkit.utils.routed_rows import gather_rows, sum_rows
from shardkit.utils.suggest import did_you_mean

__all__ = ["MoE", "MoEConfig", "TopKRouter", "expert_load", "moe_aux_loss", "moe_layers", "update_router_biases"]

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of the MoE layers of a model.

    Args:
        num_experts: routed experts per layer.
        top_k: experts each token is sent to.
        intermediate_size: each expert's SwiGLU width.
        num_shared_experts: experts every token goes through (DeepSeek's shared experts), as one SwiGLU of
            ``num_shared_experts * shared_intermediate_size``; 0: none.
        shared_intermediate_size: each shared expert's width (default: ``intermediate_size``).
        score_func: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3).
        norm_topk_prob: divide the picked weights by their sum.
        route_scale: factor on the routing weights (DeepSeek-V3's ``routed_scaling_factor``).
        aux_loss_coef: weight of the load-balancing loss added to the training loss; 0: none.
        bias_update_rate: step of the auxiliary-loss-free bias update (:func:`update_router_biases`); 0: the bias
            stays at zero.
        capacity_factor: None (dropless) or a number > 0: each expert's capacity relative to a uniform load.
        first_dense_layers: the first layers keep a dense MLP (DeepSeek's ``first_k_dense_replace``).
        experts_backend: "auto" (``torch._grouped_mm`` where it works on the device and dtype, else a loop over
            experts), "grouped_mm", "bmm" (padded batched matmul) or "loop".
    """

    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 64
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    first_dense_layers: int = 0
    experts_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig {name}={value!r} must be an int >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig top_k({self.top_k}) > num_experts({self.num_experts}): a token cannot pick "
                             "more experts than there are")
        for name in ("num_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MoEConfig {name}={value!r} must be an int >= 0")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig score_func={self.score_func!r} is not one of {SCORE_FUNCS}"
                             f"{did_you_mean(str(self.score_func), SCORE_FUNCS)}")
        if self.experts_backend not in EXPERT_BACKENDS:
            raise ValueError(f"MoEConfig experts_backend={self.experts_backend!r} is not one of {EXPERT_BACKENDS}"
                             f"{did_you_mean(str(self.experts_backend), EXPERT_BACKENDS)}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"MoEConfig capacity_factor={self.capacity_factor!r} must be None (dropless) or a "
                             "finite number > 0")
        size = self.shared_intermediate_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            # 0 would fall back to intermediate_size unsaid (``size or intermediate_size``)
            raise ValueError(f"MoEConfig shared_intermediate_size={size!r} must be None (intermediate_size) or an "
                             "int >= 1; no shared experts is num_shared_experts=0")
        if not isinstance(self.norm_topk_prob, bool):
            # a string such as "false" from a hand-written config would be truthy
            raise ValueError(f"MoEConfig norm_topk_prob={self.norm_topk_prob!r} must be True or False")
        if isinstance(self.route_scale, bool) or not isinstance(self.route_scale, (int, float)) \
                or not (self.route_scale > 0 and math.isfinite(self.route_scale)):
            raise ValueError(f"MoEConfig route_scale={self.route_scale!r} must be a finite number > 0 (a factor on "
                             "the routing weights)")
        for name in ("aux_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"MoEConfig {name}={value!r} must be a finite number >= 0")

    @classmethod
    def from_value(cls, value: MoEConfig | dict | None) -> MoEConfig | None:
        """A config from itself, a dict of its fields (as ``to_dict`` and JSON give it) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f for f in cls.__dataclass_fields__}
            unknown = [k for k in value if k not in known]
            if unknown:
                raise ValueError(f"MoEConfig has no field {unknown[0]!r}{did_you_mean(str(unknown[0]), known)}")
            return cls(**value)
        raise ValueError(f"moe must be a MoEConfig, a dict of its fields or None, not {type(value).__name__}")

    def to_dict(self) -> dict:
        return asdict(self)


class TopKRouter(nn.Module):
    """Scores every expert for every token and picks ``top_k`` (see the module docstring)."""

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.init_weights()
        # Steers the choice only (never the weights); saved with the model so that a resumed run routes the same.
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def init_weights(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (N, E), picked experts (N, k), their routing weights (N, k)) for tokens ``x`` (N, H)."""
        cfg = self.config
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(wide), self.weight.to(wide))
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias.to(wide)
        # A stable descending sort: among equal scores the lower expert index wins, on every device and backend.
        picked = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : cfg.top_k]
        weights = scores.gather(1, picked)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(wide).tiny)
        return scores, picked, weights * cfg.route_scale


class LocalDispatch:
    """Every expert on this device: the grouped GEMM over the sorted tokens; statistics are this process's."""

    # Every expert on this rank: the layer runs its routed function (no sorted copy of the tokens kept).
    routes_locally = True

    def run(self, experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(tokens, counts)

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        return local


_LOCAL = LocalDispatch()
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class MoE(nn.Module):
    """Routed experts (and shared ones) in place of a dense MLP; ``forward(x)`` keeps ``x``'s shape.

    After a forward: :attr:`aux_loss` (training only: the load-balancing loss times ``aux_loss_coef``, None when
    the coefficient is 0), :attr:`last_load` (assignments per expert, over the data-parallel ranks under expert
    parallelism) and :attr:`dropped` (assignments over capacity).
    """

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(hidden_size, config)
        self.experts = GroupedExperts(config.num_experts, hidden_size, config.intermediate_size,
                                      backend=config.experts_backend)
        width = (config.shared_intermediate_size or config.intermediate_size) * config.num_shared_experts
        self.shared_experts = PlainSwiGLUMLP(hidden_size, width) if width else None
        # Expert parallelism installs its dispatcher here (run / global_sum / global_counts); None: all local.
        self.dispatcher: Any = None
        # Assignments per expert since the last bias update (training forwards only), for update_router_biases.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float64),
                             persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.dropped = 0

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        super()._apply(fn, recurse)
        # A cast of the whole model (``model.bfloat16()``, a bf16 engine) must not reach the balancing state: the
        # bias moves by steps of ``bias_update_rate`` (1e-3 is below bf16's spacing from 0.25 up, so the update
        # would round away) and the counts pass bf16's exact integers at 256.
        if self.tokens_per_expert.dtype in _LOW_PRECISION:
            self.tokens_per_expert = self.tokens_per_expert.to(torch.float64)
        if self.router.expert_bias.dtype in _LOW_PRECISION:
            self.router.expert_bias = self.router.expert_bias.to(torch.float32)
        return self

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (..., hidden); ``token_mask`` (x's shape less hidden), False at padding: see the module docstring."""
        cfg = self.config
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        real = None if token_mask is None else _check_token_mask(token_mask, shape)
        dispatch = self.dispatcher or _LOCAL
        scores, picked, weights = self.router(x)
        flat = picked.reshape(-1)
        tokens = x.shape[0]
        if real is not None:
            # Padding's assignments take a sentinel expert past the last: the stable sort puts them after every real
            # one, in one piece that is cut off, so no expert and no capacity slot sees them.
            flat = flat.masked_fill(~real.repeat_interleave(cfg.top_k), cfg.num_experts)
            tokens = int(real.sum())
        order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, in token order inside each
        experts_sorted = flat[order]
        if real is not None:
            order, experts_sorted = order[: tokens * cfg.top_k], experts_sorted[: tokens * cfg.top_k]
        routed = torch.bincount(experts_sorted, minlength=cfg.num_experts)
        keep = None
        if cfg.capacity_factor is not None:
            capacity = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.num_experts)
            starts = torch.searchsorted(experts_sorted, torch.arange(cfg.num_experts, device=x.device))
            keep = torch.arange(order.numel(), device=x.device) - starts[experts_sorted] < capacity
            dropped = int(order.numel() - keep.sum())
            order, experts_sorted = order[keep], experts_sorted[keep]
        else:
            dropped = 0
        if not _in_backward():  # not activation checkpointing's recompute (see _statistics)
            self.dropped = dropped
        counts = torch.bincount(experts_sorted, minlength=cfg.num_experts)
        token = order // cfg.top_k
        picked_weights = weights.reshape(-1)[order]
        if self.dispatcher is None or getattr(dispatch, "routes_locally", False):
            # Gather, experts, weighting and sum in one function that keeps no sorted copy of the tokens (also when a
            # strategy only reduces the statistics: context parallelism and pipelines keep every expert here).
            y = self.experts.routed(x, token, picked_weights, counts)
        else:
            # The experts' outputs come back in x's dtype; the sums per token (and their gradients') run in fp32, as
            # in the routed function, so a model sums alike with its experts here or on other ranks.
            out = dispatch.run(self.experts, gather_rows(x, token), counts)
            out = out * picked_weights.unsqueeze(-1).to(out.dtype)
            y = sum_rows(out, token, x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        self._statistics(scores if real is None else scores[real], routed, dispatch)
        return y.reshape(shape)

    def _statistics(self, scores: torch.Tensor, routed: torch.Tensor, dispatch: Any) -> None:
        """The load (before any capacity drop, as the balancing terms want it) and the auxiliary loss.

        The loss is DeepSeek's form ``coef * sum_e f_e * P_e`` with ``f_e = E / (k * N) * assignments_e`` and
        ``P_e`` the mean (normalised, for sigmoid) score of expert e: 1 at a uniform load. Under expert parallelism
        both are over every data-parallel rank's tokens, so the value is the one-device value of the whole batch.
        """
        cfg = self.config
        with torch.no_grad():
            totals = dispatch.global_counts(torch.cat([routed.to(torch.float64),
                                                       routed.new_tensor([scores.shape[0]], dtype=torch.float64)]))
        load, tokens = totals[:-1], totals[-1].clamp(min=1)
        # Activation checkpointing runs this forward a second time inside the backward (the recompute): it must
        # rebuild the aux loss's graph (its saved tensors), but the tokens were counted in the first run, so the
        # counts, the load and the loss the caller read stay as that run left them. Counting again would weigh a
        # checkpointed step twice against any forward that is not recomputed (a train-mode forward under no_grad,
        # a layer outside the checkpointed blocks), and the bias update would move otherwise than without it.
        recompute = _in_backward()
        if not recompute:
            self.last_load = load
        if not self.training:
            self.aux_loss = None
            return
        if not recompute:
            self.tokens_per_expert += load
        if cfg.aux_loss_coef == 0:
            if not recompute:
                self.aux_loss = None
            return
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True).clamp(min=1e-20)
        mean_probs = dispatch.global_sum(probs.sum(0)) / tokens.to(probs.dtype)
        f = load.to(probs.dtype) * (cfg.num_experts / (cfg.top_k * tokens.to(probs.dtype)))
        aux_loss = cfg.aux_loss_coef * (f * mean_probs).sum()
        if not recompute:  # the recompute's copy only feeds the checkpoint's saved tensors; keep none of it alive
            self.aux_loss = aux_loss


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward then is activation checkpointing's
    recompute (torch's FSDP2 tells its own backward apart the same way)."""
    return torch._C._current_graph_task_id() != -1


def _check_token_mask(token_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``token_mask`` flattened to one bool per token of an input of ``shape``, or a ValueError."""
    if tuple(token_mask.shape) != tuple(shape[:-1]):
        raise ValueError(f"MoE: token_mask of shape {tuple(token_mask.shape)} does not match the input's tokens "
                         f"{tuple(shape[:-1])}")
    if token_mask.is_floating_point() or token_mask.is_complex():
        raise ValueError(f"MoE: token_mask must hold booleans or 0/1 integers (1: a real token), not "
                         f"{token_mask.dtype}")
    return (token_mask if token_mask.dtype == torch.bool else token_mask != 0).reshape(-1)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' auxiliary losses from the last training forward, or None when there is none."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack([loss.float() if loss.dtype.itemsize < 4 else loss for loss in losses]).sum() if losses \
        else None


@torch.no_grad()
def update_router_biases(model: nn.Module, all_reduce: Callable[[torch.Tensor], Any] | None = None) -> int:
    """DeepSeek-V3's auxiliary-loss-free balancing: after an optimizer step, each MoE layer's ``expert_bias`` moves by
    ``bias_update_rate`` up for experts that got fewer assignments than the mean since the last update, down for
    those that got more; the counts restart. Returns the number of layers updated.

    Args:
        all_reduce: sums a tensor over the data-parallel ranks in place (``runner.all_reduce``). Needed under data
            parallelism without expert parallelism, whose counts are each rank's own: without it the ranks' biases
            would drift apart. Under expert parallelism the counts are already the whole batch's (a second sum only
            scales them, which leaves the update's direction as it is). A layer whose dispatcher has
            ``reduce_counts`` (a pipeline stage's) sums its counts there instead when that returns True.
    """
    updated = 0
    for layer in moe_layers(model):
        rate = layer.config.bias_update_rate
        counts = layer.tokens_per_expert
        if rate == 0:
            counts.zero_()
            continue
        # A strategy whose ranks hold different MoE layers (a pipeline's stages) sums each layer's counts over
        # that layer's own data-parallel peers (``reduce_counts``); a per-layer collective over every rank
        # would pair different layers across stages.
        reduce_counts = getattr(layer.dispatcher, "reduce_counts", None)
        if not (reduce_counts is not None and reduce_counts(counts)) and all_reduce is not None:
            all_reduce(counts)
        bias = layer.router.expert_bias
        bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)
        counts.zero_()
        updated += 1
    return updated


def expert_load(model: nn.Module) -> dict[str, float]:
    """Per MoE layer, from the last forward: its aux loss, the max/mean assignments per expert, the tokens dropped over
    capacity and the router bias's spread; flat names (``moe/layer{i}/...``) for ``runner.log``."""
    out: dict[str, float] = {}
    for i, layer in enumerate(moe_layers(model)):
        key = f"moe/layer{i}"
        if layer.last_load is not None:
            load = layer.last_load
            out[f"{key}/max_over_mean_load"] = float(load.max() / load.mean().clamp(min=1e-12))
            out[f"{key}/min_load"] = float(load.min())
        if layer.aux_loss is not None:
            out[f"{key}/aux_loss"] = float(layer.aux_loss.detach())
        out[f"{key}/dropped"] = float(layer.dropped)
        bias = layer.router.expert_bias
        out[f"{key}/bias_abs_max"] = float(bias.abs().max())
    return out
