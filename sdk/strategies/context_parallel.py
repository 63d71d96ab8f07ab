"""Context parallelism: each sequence split across the ``cp`` ranks of the mesh, composed with FSDP2.

The mesh is :class:`~shardkit.strategies.parallel_dims.ParallelDims` ``(dp_replicate, dp_shard, cp)``. Parameters are
sharded by FSDP2 over ``dp_shard x cp`` flattened (cp peers hold the same weights, so they may as well
share the shards, as torchtitan does) and replicated over ``dp_replicate``. Every cp peer gets the same
batch from the loader (:attr:`data_parallel_rank`); the model's forward takes its two load-balanced
chunks (:mod:`~shardkit.strategies.cp_attention`), runs the layers on them with their true rotary
positions and attention over the whole sequence (Ulysses or ring), and returns the loss of the whole
sequence, token-weighted across the cp group, on every cp rank.

Why the gradients come out right: the loss is ``all_reduce_sum(local_sum) / tokens`` with autograd, so
each rank's backward is ``cp`` times its local tokens' share; FSDP2 averages over ``dp_shard * cp`` ranks,
which leaves the mean over the data-parallel batches: what DDP gives on the same sequences.

With ``tp_size > 1`` (CP x TP) the mesh gains its innermost ``tp`` dimension: each layer's attention heads
and MLP matrices are split over ``tp`` as :class:`~shardkit.strategies.TensorParallel` splits them (the model's
own plan), then FSDP2 shards over ``dp_shard x cp`` as above (2-D with TP's DTensors). Attention runs over each
rank's ``num_heads / tp`` local heads: ring for any count, Ulysses when ``cp`` divides it. TP's output
projections all-reduce over ``tp``, so the loss and the replicated parts (norms, embedding, head) are equal on the
tp peers, and DTensor's backward gives them whole gradients; the cp scaling above is untouched by ``tp``.

Forwards without labels (evaluation logits, generation) run the whole sequence on every rank, unsplit.

MoE layers (shardkit's Llama with ``config.moe``) route each rank's chunk through every expert; their routing
statistics are summed over the cp group (:mod:`~shardkit.strategies.cp_moe`), so the auxiliary loss added to the
loss, the load and the counts of the aux-loss-free bias update are the whole sequences', as on one device. To
split the experts over the cp ranks too (expert parallelism), use
:class:`~shardkit.strategies.expert_parallel.ExpertParallel` with ``cp_size``, which installs this forward itself.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from shardkit.strategies import fsdp as _fsdp
from shardkit.strategies.cp_attention import RingAttention, UlyssesAttention, load_balanced_positions, shard_sequence
from shardkit.strategies.cp_moe import GroupStatistics, install_statistics, moe_aux_loss
from shardkit.strategies.parallel import ProcessGroupStrategy
from shardkit.strategies.parallel_dims import CP_MODES, ParallelDims
from shardkit.strategies.tensor_parallel import resolve_plan
from shardkit.utils.suggest import did_you_mean

__all__ = ["ContextParallel", "context_parallel_forward", "install_context_parallel"]


class ContextParallel(_fsdp.FSDP):
    """Context parallelism (ring or Ulysses attention) over ``cp`` ranks, FSDP2 over the rest of the world.

    Args:
        cp_size: ranks that split each sequence; must divide the world size. None: every rank.
        cp_mode: "ring" (key/value blocks around the ring, any head count) or "ulysses" (all-to-all
            between sequence and heads; heads divisible by cp).
        dp_replicate: replicas across which FSDP2 shards are replicated (HSDP); the rest is dp_shard.
        sharding, state_dict_type, timeout: as :class:`~shardkit.strategies.FSDP` ("full" or "grad_op").
        tp_size: ranks that split each layer's heads and MLP matrices (tensor parallelism inside each cp rank's
            work, CP x TP); neighbouring ranks, innermost in the mesh. 1: no tensor parallelism.
        tp_plan: with ``tp_size > 1``, the tensor-parallel plan (FQN pattern -> ParallelStyle); None: the
            model's own, as :func:`~shardkit.strategies.tensor_parallel.resolve_plan` finds it.
        sequence_parallel: with ``tp_size > 1``, the model's own plan in its sequence-parallel form (the norms and
            the residual stream between blocks split over tp along each rank's chunk of the sequence).
        ep_size: refused above 1: expert parallelism with context parallelism is
            :class:`~shardkit.strategies.expert_parallel.ExpertParallel` with ``cp_size`` (one place selects it).
    """

    def __init__(self, cp_size: int | None = None, cp_mode: str = "ring", dp_replicate: int = 1,
                 sharding: str = "full", state_dict_type: str = "sharded", timeout: float | None = None,
                 tp_size: int = 1, tp_plan: dict[str, Any] | None = None, sequence_parallel: bool = False,
                 ep_size: int | None = None):
        if ep_size not in (None, 1):
            cp = cp_size if cp_size is not None else "N"
            raise ValueError(f"ContextParallel(ep_size={ep_size!r}): expert parallelism composed with context "
                             f"parallelism is ExpertParallel(ep_size={ep_size!r}, cp_size={cp}) (--strategy ep "
                             f"--strategy-opt ep_size={ep_size!r} --strategy-opt cp_size={cp}); ContextParallel runs "
                             "every expert on every rank")
        if cp_mode not in CP_MODES:
            raise ValueError(f"ContextParallel cp_mode={cp_mode!r} is not one of {CP_MODES}"
                             f"{did_you_mean(str(cp_mode), CP_MODES)}")
        if sharding not in ("full", "grad_op"):
            raise ValueError(f"ContextParallel sharding={sharding!r}: use 'full' or 'grad_op' (replicas across "
                             "nodes are dp_replicate=N)")
        super().__init__(sharding=sharding, state_dict_type=state_dict_type, timeout=timeout)
        for name, value, meaning in (("cp_size", cp_size, "None: the ranks that dp_replicate and tp leave"),
                                     ("dp_replicate", dp_replicate, "1: no replicas"),
                                     ("tp_size", tp_size, "1: no tensor parallelism")):
            if value is None and name == "cp_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ContextParallel {name}={value!r} must be an int >= 1 ({meaning})")
        if tp_plan is not None and tp_size == 1:
            raise ValueError("ContextParallel tp_plan=... is a tensor-parallel plan: it needs tp_size > 1 "
                             "(e.g. ContextParallel(cp_size=2, tp_size=2, tp_plan=...))")
        if sequence_parallel and (tp_size == 1 or tp_plan is not None):
            raise ValueError("ContextParallel sequence_parallel=True splits the model's own tensor-parallel plan: it "
                             "needs tp_size > 1 and no tp_plan (put SequenceParallel() styles in tp_plan instead)")
        _check_plan(tp_plan)
        self.sequence_parallel = sequence_parallel
        self.cp_mode = cp_mode
        self._cp_size = cp_size
        self.tp_plan = tp_plan
        self.dims = ParallelDims(dp_replicate=dp_replicate, cp=cp_size or 1, tp=tp_size)
        self.world_mesh: Any = None

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    @override
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: dp_replicate * dp_shard (cp and tp peers share one)."""
        return self.world_size // (self.dims.cp * self.dims.tp)

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.rank // (self.dims.cp * self.dims.tp)  # cp and tp are the innermost dimensions

    @property
    def cp_group(self) -> Any:
        return self.world_mesh["cp"].get_group()

    @override
    def setup_environment(self) -> None:
        ProcessGroupStrategy.setup_environment(self)
        cp = self._cp_size or max(1, self.world_size // (self.dims.tp * self.dims.dp_replicate))
        self.dims = dataclasses.replace(self.dims, cp=cp, dp_shard=-1).resolve(self.world_size)
        self.world_mesh = self.dims.build(self.device_type)
        shard = ParallelDims.submesh(self.world_mesh, ("dp_shard", "cp"))
        self.mesh = shard if self.dims.dp_replicate == 1 else \
            self.world_mesh["dp_replicate", "dp_shard_cp"]

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        attention = (UlyssesAttention if self.cp_mode == "ulysses" else RingAttention)(self.cp_group)
        install_context_parallel(module, attention, self.dims, self.cp_mode)
        return super().setup_module(module)

    @override
    def _shard(self, module: nn.Module) -> None:
        """Tensor parallelism first (whole weights, rank 0's after the broadcast or the recorded init's meta ones),
        then FSDP2's units over ``dp_shard x cp`` on top of TP's DTensors."""
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            # src_data_rank=None: each rank cuts its part from its own copy, no scatter. The copies are already
            # equal (rank 0's broadcast, or the recorded init replayed later); with empty_init=True only rank 0
            # has real weights and a scatter from it would wait on meta ranks that never join (seen: a hang).
            plan = resolve_plan(module, self.tp_plan, self.dims.tp, self.sequence_parallel)
            parallelize_module(module, self.world_mesh["tp"], plan, src_data_rank=None)
        super()._shard(module)

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(cp_size=self.dims.cp, cp_mode=self.cp_mode, dp_replicate=self.dims.dp_replicate,
                    tp_size=self.dims.tp)
        return info

    def __repr__(self) -> str:
        tp = f", tp_size={self.dims.tp}" if self.dims.tp > 1 else ""
        return f"ContextParallel(cp_size={self.dims.cp}{tp}, cp_mode={self.cp_mode!r}, device={self._device})"


def _check_plan(plan: Any) -> None:
    """``tp_plan`` maps FQN patterns to ParallelStyle objects (a config file's strings are not styles)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None:
        return
    if not isinstance(plan, dict):
        raise ValueError(f"ContextParallel tp_plan must be a dict of FQN pattern -> ParallelStyle, not a "
                         f"{type(plan).__name__}")
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise ValueError(f"ContextParallel tp_plan entry {str(key)[:80]!r}: {type(style).__name__} is not a "
                             "ParallelStyle; use e.g. {'layers.*.mlp.up_proj': ColwiseParallel()} from "
                             "torch.distributed.tensor.parallel (or leave tp_plan unset for the model's own plan)")


def _attention_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "core") and hasattr(m, "rotary")]


def install_context_parallel(module: nn.Module, attention: Any, dims: ParallelDims, cp_mode: str,
                             owner: str = "ContextParallel") -> None:
    """Route ``module``'s training forward through the split sequence (shardkit's Llama, Hugging Face decoders):
    ``attention`` (ring or Ulysses over the cp group) in place of each attention core, the forward replaced by
    :func:`context_parallel_forward`, MoE layers' statistics summed over the cp group until a strategy (expert
    parallelism) puts its own dispatcher in their slot. ``owner`` is the strategy named in errors."""
    from shardkit.strategies import cp_hf

    cfg = getattr(module, "config", None)
    if cp_hf.is_hf_decoder(module) and cp_hf.hf_attention_modules(module):
        _refuse_hf_router_loss(module, owner)
        dims.validate(num_heads=getattr(cfg, "num_attention_heads", None),
                      num_kv_heads=getattr(cfg, "num_key_value_heads", None), cp_mode=cp_mode)
        cp_hf.install_hf(module, attention)
    else:
        attns = _attention_modules(module)
        if not attns or not callable(getattr(module, "hidden_states", None)) or not hasattr(module, "lm_head"):
            raise ValueError(f"{owner} (context parallelism) needs attention it can replace: shardkit's Llama "
                             f"(attention modules with a `core`, `hidden_states` and `lm_head`) or a Hugging Face "
                             f"decoder that dispatches through ALL_ATTENTION_FUNCTIONS (Llama, Qwen2, ...); "
                             f"{type(module).__name__} is neither")
        dims.validate(num_heads=getattr(cfg, "num_heads", None), num_kv_heads=getattr(cfg, "kv_heads", None),
                      cp_mode=cp_mode)
        for attn in attns:
            attn.core = attention
    # MoE layers route each rank's chunk; their load and auxiliary loss are summed over the cp group (cp_moe.py).
    module._shardkit_cp_moe = install_statistics(module, owner,
                                                 lambda: GroupStatistics(attention.group, grad_scale=attention.size))
    module._shardkit_cp = attention
    module.forward = types.MethodType(context_parallel_forward, module)


def _refuse_hf_router_loss(module: nn.Module, owner: str = "ContextParallel") -> None:
    """A Hugging Face MoE decoder that adds its router loss to the training loss (``output_router_logits`` with a
    non-zero ``router_aux_loss_coef``) is refused: the split forward takes the loss from the logits alone."""
    cfg = module.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    coef = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
    if getattr(text, "output_router_logits", False) and coef:
        raise ValueError(f"{owner}: {type(module).__name__} adds its router load-balancing loss "
                         f"(router_aux_loss_coef={coef}, output_router_logits=True) to its training loss, which the "
                         "split-sequence forward would leave out; set output_router_logits=False in its config to "
                         "train without it, or train it without context parallelism (--strategy ep without cp_size, "
                         "or fsdp)")


def context_parallel_forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                             **kwargs: Any) -> Any:
    """The forward ContextParallel installs: with labels, the whole sequences' mean next-token loss computed
    from this rank's chunks (shardkit's Llama: the loss; a Hugging Face model: its output with ``.loss`` set and
    this rank's logits); without, the model's own forward over the whole sequence (every rank)."""
    from shardkit.strategies import cp_hf

    attention = self._shardkit_cp
    if cp_hf.is_hf_decoder(self):
        if labels is None:
            return type(self).forward(self, input_ids=input_ids, **kwargs)
        attention.seq_len = input_ids.shape[1]
        positions = load_balanced_positions(input_ids.shape[1], attention.size, attention.rank, input_ids.device)
        local_sum, count, out = cp_hf.hf_split_forward(self, input_ids, _shift(labels), positions,
                                                       kwargs.pop("attention_mask", None), **kwargs)
        out.loss = _group_loss(local_sum, count, attention)
        return out
    if labels is not None and kwargs == {"return_log_probs": True}:
        return _split_log_probs(self, input_ids, labels, attention)
    if labels is None or kwargs:
        cores = _attention_modules(self)
        for attn in cores:
            attn.core = None
        for layer in self._shardkit_cp_moe:  # every rank routes the whole sequence: nothing to sum
            layer.dispatcher.enabled = False
        try:
            return type(self).forward(self, input_ids, labels, **kwargs)
        finally:
            for attn in cores:
                attn.core = attention
            for layer in self._shardkit_cp_moe:
                layer.dispatcher.enabled = True
    seq = input_ids.shape[1]
    attention.seq_len = seq
    positions = load_balanced_positions(seq, attention.size, attention.rank, input_ids.device)
    hidden = self.hidden_states(shard_sequence(input_ids, positions), position_ids=positions)
    local_labels = shard_sequence(_shift(labels), positions).reshape(-1)
    count = (local_labels != -100).sum()
    if int(count):
        local_sum = self.lm_head(hidden.reshape(-1, hidden.shape[-1]), local_labels) * count
    else:  # every local label ignored: no loss here, but the graph (and FSDP's hooks) still run
        local_sum = hidden.sum() * 0.0
    loss = _group_loss(local_sum, count, attention)
    # The whole sequence's auxiliary loss on every rank, its gradient cp times this rank's share as the loss's.
    aux = moe_aux_loss(self._shardkit_cp_moe) if self.training else None
    return loss if aux is None else loss + aux.to(loss.dtype)


def _split_log_probs(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, attention: Any) -> torch.Tensor:
    """shardkit Llama's ``return_log_probs=True`` on this rank's chunks: the per-token log-probs are local (each
    rank scores its own positions, no logits), then gathered into the whole (B, T) on every rank for the caller's
    per-sequence sums. The value is the whole sequence's; the gradient reaches this rank's positions only, times
    the cp size (FSDP2's mean over dp_shard * cp takes it back out, as in :func:`_group_loss`)."""
    if not callable(getattr(self, "label_log_probs", None)):
        raise NotImplementedError(f"ContextParallel: return_log_probs=True needs the model's label_log_probs(hidden, "
                                  f"shifted_labels) (shardkit's Llama has it); {type(self).__name__} has none")
    seq = input_ids.shape[1]
    attention.seq_len = seq
    positions = load_balanced_positions(seq, attention.size, attention.rank, input_ids.device)
    hidden = self.hidden_states(shard_sequence(input_ids, positions), position_ids=positions)
    local = self.label_log_probs(hidden, shard_sequence(_shift(labels), positions))
    parts = [torch.empty_like(local) for _ in range(attention.size)]
    dist.all_gather(parts, local.detach().contiguous(), group=attention.group)
    whole = local.new_zeros(local.shape[0], seq)
    for rank, part in enumerate(parts):
        whole[:, load_balanced_positions(seq, attention.size, rank, input_ids.device)] = part
    mine = torch.zeros_like(whole).index_copy(1, positions, local * attention.size)
    return whole + (mine - mine.detach())


def _shift(labels: torch.Tensor) -> torch.Tensor:
    """Shift before splitting: the label of position t is token t+1, which may live on another rank."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _group_loss(local_sum: torch.Tensor, count: torch.Tensor, attention: Any) -> torch.Tensor:
    """The cp group's token-weighted mean loss from this rank's sum and count, with this rank's gradient."""
    totals = torch.stack([local_sum.detach(), count.to(local_sum.dtype)])
    dist.all_reduce(totals, group=attention.group)
    tokens = totals[1].clamp(min=1)
    # The value is the group's loss; the gradient reaching local_sum is cp / tokens, as an autograd
    # all-reduce would give (FSDP2's mean over dp_shard * cp takes the cp back out).
    scaled = local_sum * (attention.size / tokens)
    return scaled + (totals[0] / tokens - scaled).detach()
