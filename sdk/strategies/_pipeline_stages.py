"""The stages of a pipeline-parallel model and the forward that runs a schedule over them (see pipeline.py).

Each rank keeps only its stages' parts of the user's model, under their own names: ``layers`` becomes an
``nn.ModuleDict`` keyed by the original indices (so ``layers.5.mlp...`` stays ``layers.5.mlp...``) and the
embedding, final norm and output head are ``None`` on the ranks that do not run them.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from typing_extensions import override

from shardkit.strategies._dtensor import local_tensor
from shardkit.strategies._pipeline_hf_moe import make_stage
from shardkit.strategies._pipeline_models import ModelLayout, StageModule, model_layout
from shardkit.strategies.cp_moe import GroupStatistics, install_statistics
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.pipeline_settings import SCHEDULES, PipelineSettings, stage_layers

__all__ = ["PipelineRunner", "StageModule", "WindowStage", "gather_optimizer_state", "iter_full_state",
           "own_optimizer_state"]


_AT_LEAST_ONE_PER_STAGE = ("dualpipev",)  # torch's DualPipeV refuses fewer micro-batches than stages


def _check_model(module: nn.Module, stages: int, split: tuple[int, ...] | None) -> ModelLayout:
    layout = model_layout(module)
    ParallelDims(pp=stages, dp_shard=1).validate(num_layers=len(layout.body.layers), layer_split=split)
    return layout


class PipelineRunner:
    """This rank's stages, the schedule over them, and the forward installed on the user's model.

    ``shard``: called on each stage module before its ``PipelineStage`` is built (FSDP2 over ``dp_shard``); the
    stages' gradients are then reduced by it, not by this runner's all-reduce.
    """

    def __init__(self, module: nn.Module, settings: PipelineSettings, mesh: Any, device: torch.device,
                 loss_scale: Callable[[], tuple[int, bool]], scale_loss: Callable[[torch.Tensor], torch.Tensor],
                 shard: Callable[[nn.Module], None] | None = None):
        import torch.distributed.pipelining as pipelining

        pp = settings.pp_size
        total = pp * settings.chunks
        layout = self.layout = _check_model(module, total, settings.layer_split)
        body, self.sharded = layout.body, shard is not None
        self.settings, self.loss_scale, self.scale_loss = settings, loss_scale, scale_loss
        # The whole model's names in state_dict order, and the tied embedding/head weight (summed across
        # the first and last stages' ranks after backward, so both copies step alike).
        self.keys = list(module.state_dict().keys())
        tied = module.lm_head.weight is body.embed_tokens.weight
        self.tied_shape = tuple(body.embed_tokens.weight.shape) if tied else None
        prefix = next(n + "." for n, m in module.named_modules() if m is body) if body is not module else ""
        self.tied_keys = ("lm_head.weight", f"{prefix}embed_tokens.weight")
        # The first and last stages on one rank (V placement, or pp 1) share the tied weight as one parameter,
        # which autograd already sums: only stages on different ranks need the gradient summed across them.
        together = {0, total - 1} <= set(settings.stage_indices(0))
        self.tied_apart = tied and not together
        if tied and shard is not None and together:
            # FSDP2 would shard the one weight twice (once per stage) into two parameters that train apart.
            apart = "schedule='zero_bubble' (the stages apart), " if pp > 1 else ""
            raise ValueError(f"Pipeline schedule={settings.schedule!r} with dp='fsdp' runs the first and the last "
                             "stage on pipeline rank 0, and this model ties its output head to its embedding: FSDP2 "
                             f"cannot shard one weight in two stages; use {apart}dp='ddp', or untie the embeddings")
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp_shard"].get_group()
        # MoE layers: each micro-batch routes apart (its statistics its own, as under gradient accumulation), and a
        # bias update sums each layer's counts over its stage's data-parallel peers, the ranks holding that layer.
        self.moe = bool(install_statistics(module, "Pipeline", lambda: GroupStatistics(counts_group=self.dp_group)))
        self.moe = self.moe or layout.router_aux  # an HF MoE decoder's aux loss, carried between its stages
        self.pp_rank, self.pp = dist.get_rank(self.pp_group), pp
        ranges = stage_layers(len(body.layers), total, settings.layer_split)
        self.indices = settings.stage_indices(self.pp_rank)
        first, last = 0 in self.indices, total - 1 in self.indices
        owned = {i for s in self.indices for i in ranges[s]}
        self.stages = []
        for s in self.indices:
            part = make_stage(layout, body.embed_tokens if s == 0 else None, [body.layers[i] for i in ranges[s]],
                              body.norm if s == total - 1 else None, module.lm_head if s == total - 1 else None,
                              stats_group=self.dp_group)
            if shard is not None:
                shard(part)
            self.stages.append(WindowStage(part, s, total, device, group=self.pp_group,
                                           sync=lambda: self.loss_scale()[1]))
        body.layers = nn.ModuleDict({str(i): body.layers[i] for i in sorted(owned)})
        for owner, name, keep in ((body, "embed_tokens", first), (body, "norm", last), (module, "lm_head", last)):
            if not keep:
                setattr(owner, name, None)
        self.first, self.last, self.module = first, last, module
        self.last_pp_rank = next(r for r in range(pp) if total - 1 in settings.stage_indices(r))
        self.schedule_class = getattr(pipelining, SCHEDULES[settings.schedule])
        self._schedules: dict[int, Any] = {}
        self._batch: tuple[torch.Tensor, int] = (torch.ones(()), 1)
        module.forward = types.MethodType(_pipeline_forward, module)

    def schedule(self, microbatches: int) -> Any:
        """The schedule for ``microbatches``, built once: a new one per step would redo the stages' setup
        (shape inference and buffers: measured 2x the step time of a reused one, benchmarks/pipeline.py)."""
        if microbatches not in self._schedules:
            stage = self.stages if self.settings.chunks > 1 else self.stages[0]
            self._schedules[microbatches] = self.schedule_class(stage, microbatches, loss_fn=self._loss,
                                                                scale_grads=False)
        return self._schedules[microbatches]

    def _loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the batch's token-weighted mean (and of the accumulation window)."""
        tokens, accumulation = self._batch
        shift = target[:, 1:].reshape(-1)
        count = (shift != -100).sum()
        if not int(count):
            return hidden.sum() * 0.0
        mean = self.layout.head_loss(self.module.lm_head, hidden[:, :-1].reshape(-1, hidden.shape[-1]), shift)
        return self.scale_loss(mean * count / tokens / accumulation)

    def microbatches(self, batch: int, window: int) -> int:
        """Pieces a batch of ``batch`` rows is cut into: the user's ``microbatches``, else the accumulation window's
        length (``gradient_accumulation_steps`` or ``begin_window``) when it is over 1, else ``pp_size`` (for
        dualpipev at least one per stage)."""
        explicit = self.settings.microbatches
        n = explicit or (window if window > 1 else self.pp)
        stages = self.pp * self.settings.chunks
        if self.settings.schedule in _AT_LEAST_ONE_PER_STAGE and n < stages:
            if not explicit:
                n = stages
            else:
                raise ValueError(f"Pipeline schedule={self.settings.schedule!r} needs at least one micro-batch per "
                                 f"stage (pp_size({self.pp}) x 2 = {stages}), got microbatches={n}: set "
                                 f"Pipeline(microbatches=...) (--strategy-opt microbatches=N) to {stages} or more, "
                                 "with a batch size it divides")
        if batch % n == 0:
            return n
        if explicit:
            raise ValueError(f"Pipeline: batch size({batch}) % microbatches({n}) != 0; use a batch size that is a "
                             f"multiple of {n}, or Pipeline(microbatches=...) that divides it")
        source = f"the accumulation window ({window} micro-batches)" if window > 1 else f"pp_size({self.pp})"
        raise ValueError(f"Pipeline: batch size({batch}) % microbatches({n}) != 0; with no microbatches given the "
                         f"pipeline cuts each batch into {n} pieces, from {source}; use a batch size that is a "
                         f"multiple of {n}, or set Pipeline(microbatches=...) (--strategy-opt microbatches=N) to a "
                         f"divisor of {batch}")

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the batch's token-weighted mean loss on every rank."""
        accumulation, sync = self.loss_scale()
        n = self.microbatches(input_ids.shape[0], accumulation)
        self._batch = ((labels[:, 1:] != -100).sum().clamp(min=1).float(), accumulation)
        # Each micro-batch's auxiliary loss weighs 1/n of the step's loss (and of the window's, scaled as the loss).
        aux_weight = float(self.scale_loss(torch.ones(()))) / (n * accumulation)
        for stage in self.stages:
            stage.submod.aux_weight = aux_weight
            stage.submod.aux_values.clear()
        schedule = self.schedule(n)
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.first else ()
        kwargs = {"target": labels, "losses": losses} if self.last else {}
        schedule.step(*args, **kwargs)
        total = torch.zeros((), device=input_ids.device)
        if self.last:
            unscaled = [self.scale_loss(torch.ones((), device=input_ids.device))] * len(losses)
            total = sum(x.detach().float() / u for x, u in zip(losses, unscaled)) * accumulation
        last_rank = dist.get_global_rank(self.pp_group, self.last_pp_rank)
        dist.broadcast(total, src=last_rank, group=self.pp_group)
        if self.moe:  # every stage's layers' auxiliary losses, the mean over the micro-batches, summed over stages
            aux = [v.float() for stage in self.stages for v in stage.submod.aux_values]
            aux_total = (torch.stack(aux).sum() / n).to(total.device) if aux else torch.zeros_like(total)
            dist.all_reduce(aux_total, group=self.pp_group)
            total = total + aux_total
        if sync:  # once per window: the tied copies' gradients summed on every call would count earlier calls twice
            self._sum_tied_gradient()
        if sync and not self.sharded and dist.get_world_size(self.dp_group) > 1:
            self._all_reduce_gradients()
        total._shardkit_pipeline_backward_done = True
        return total

    def _sum_tied_gradient(self) -> None:
        """A tied embedding/head: the first stage's gradient and the last's, summed on both (zeros elsewhere).

        Under FSDP each rank sums its shard: the first and last stages shard the weight alike over dp_shard.
        """
        if not self.tied_apart:
            return
        body = self.layout.body
        holder = body.embed_tokens if self.first else self.module.lm_head if self.last else None
        weight = holder.weight if holder is not None else None
        if weight is not None and weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        if weight is not None:
            grad = local_tensor(weight.grad)
        else:
            grad = torch.zeros(self._tied_local_shape(), device=self.stages[0].device)
        dist.all_reduce(grad, group=self.pp_group)

    def _tied_local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's part of the tied weight: whole, or its FSDP2 dim-0 chunk over dp_shard."""
        if not self.sharded:
            return self.tied_shape
        chunks = torch.empty(self.tied_shape, device="meta").chunk(dist.get_world_size(self.dp_group))
        rank = dist.get_rank(self.dp_group)
        return tuple(chunks[rank].shape) if rank < len(chunks) else (0, *self.tied_shape[1:])

    def _all_reduce_gradients(self) -> None:
        size = dist.get_world_size(self.dp_group)
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(size)


class WindowStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP2 gradient reduction waits for the end of the Runner's accumulation window.

    torch's stage reduce-scatters an FSDP2 stage's gradients in ``perform_reduce_grad``, at the end of every
    ``schedule.step`` (every ``model(x, labels)``): on the non-final calls of a window (``sync()`` False) this
    one ends the backward as torch's does but leaves the gradients unreduced (FSDP2 keeps them unsharded and
    accumulates the next call's into them), so each FSDP unit reduce-scatters once per window, as ``dp="ddp"``
    all-reduces once. A stage that is not FSDP-sharded behaves as torch's.

    Zero-bubble's split backward (an I pass for the input gradients, a W pass later for the weights') finds the
    weights by ``submod.parameters()`` when each pass starts; FSDP2 registers the sharded parameters there once a
    unit reshards after its forward, so torch's I pass matched none of the autograd graph's (unsharded) weights
    and the W pass computed no weight gradient for those units (measured on pp 2 x dp_shard 2: the last stage's
    layer and head never reduce-scattered, losses off DDP's by 7e-3 after 3 steps). This stage gathers its units
    before each I and W pass (a unit already whole is left as it is), so both passes see the unsharded weights.

    Args:
        sync: whether the current call closes the accumulation window.
        *args, **kwargs: those of ``PipelineStage``.
    """

    def __init__(self, *args: Any, sync: Callable[[], bool], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._window_sync = sync
        # The stage's FSDP units, listed once: zero_bubble x fsdp made ~4,000 Python calls per step more than
        # torch's stages (cProfile, pp 2 x dp 2, 4 micro-batches), ~1,600 of them module walks, this one before
        # each I and W pass among them.
        self._units = [m for m in self.submod.modules() if isinstance(m, FSDPModule)]

    @override
    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """torch's run of the stage on stand-in inputs (the first stage's real micro-batch, empty tensors on the
        others) to learn its output shapes: not a micro-batch of the step, so what it leaves in the MoE layers (the
        expert counts a bias update reads) and in the stage's auxiliary losses is put back."""
        moe = self.submod.moe  # an HF MoE stage has none, but records its aux loss as the others do
        counts = [layer.tokens_per_expert.clone() for layer in moe]
        recorded = list(self.submod.aux_values)
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for layer, kept in zip(moe, counts):
                layer.tokens_per_expert.copy_(kept)
            self.submod.aux_values[:] = recorded

    @override
    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        """torch's backward of one micro-batch, the units of an FSDP stage gathered first for zero-bubble's I and W
        passes (a full backward accumulates into the graph's own weights and gathers unit by unit as torch's)."""
        if backward_type in ("input", "weight"):
            for unit in self._units:  # a unit already whole is left as it is
                unit.unshard()
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    @override
    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # NOTE: grad_scale_factor is 1 here: PipelineRunner builds its schedules with scale_grads=False (the loss
        # carries the micro-batch's share), so no scaling waits for the deferred reduction.
        if isinstance(self.submod, FSDPModule) and not self._window_sync():
            _end_backward_unreduced(self.submod)
            return
        super().perform_reduce_grad(grad_scale_factor)


def _end_backward_unreduced(module: FSDPModule) -> None:
    """End an FSDP2 stage's backward as torch's ``perform_reduce_grad`` does (post-backward of every parameter
    group, then the root's final callback), but with gradient sync off: each unit reshards its parameters and keeps
    its unsharded gradients for the next call to add to. The private calls are the ones torch 2.13's stage makes."""
    module.set_is_last_backward(True)  # clears the prefetch bookkeeping; no reduction is pending to wait for
    module.set_reshard_after_backward(True)  # the gathered parameters are freed until the next call's forward
    module.set_requires_gradient_sync(False)
    state = fully_shard.state(module)
    for inner in state._state_ctx.all_states:
        for group in inner._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _pipeline_forward(self: nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """The forward Pipeline installs: with labels, the schedule (forward and backward); else a refusal.

    An HF model returns its usual output with ``loss`` (no logits); an all-ones ``attention_mask`` is accepted.
    """
    runner = self._shardkit_pipeline
    given = sorted(k for k, v in kwargs.items() if not (v is None or v is False))  # `in` would compare tensors
    if labels is None or input_ids is None or given:
        raise NotImplementedError("Pipeline: only model(input_ids, labels=...) runs on a pipeline-split model (the "
                                  f"schedule's forward and backward){'; got ' + str(given) if given else ''}; a "
                                  "forward without labels (logits, generation) is not supported: save a checkpoint "
                                  "and load it under a single-device or FSDP strategy for evaluation and generation")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("Pipeline: an attention_mask with padding (zeros) is not supported; the stages "
                                  "apply the causal mask only: pack sequences, or pad on the right with labels=-100")
    loss = runner.run(input_ids, labels)
    if not runner.layout.hf:
        return loss
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss)


def iter_full_state(runner: PipelineRunner, is_main: bool) -> Any:
    """The whole model's state dict on the main rank, one tensor at a time in the model's own order.

    Each pipeline rank says which names it holds (one small object broadcast per stage), then each tensor is
    broadcast from its holder over the pipeline group; every rank must drive it to the end.
    """
    group, own = runner.pp_group, runner.module.state_dict()
    meta: list[Any] = [None] * runner.pp
    dist.all_gather_object(meta, {k: (tuple(v.shape), v.dtype) for k, v in own.items()}, group=group)
    for key in runner.keys:
        holder = next(j for j, held in enumerate(meta) if key in held)
        shape, dtype = meta[holder][key]
        t = _whole(own[key]).detach().contiguous() if holder == runner.pp_rank else \
            torch.empty(shape, dtype=dtype, device=runner.stages[0].device)
        dist.broadcast(t, src=dist.get_global_rank(group, holder), group=group)
        if is_main:
            yield key, t.cpu().clone()


def gather_optimizer_state(runner: PipelineRunner, state: dict[str, Any]) -> dict[str, Any] | None:
    """Every stage's optimizer state by name merged on pipeline rank 0 (None elsewhere)."""
    parts: list[Any] = [None] * runner.pp
    state = {**state, "state": {n: {k: _whole(v) for k, v in st.items()} for n, st in state["state"].items()}}
    dist.all_gather_object(parts, state, group=runner.pp_group)
    if runner.pp_rank:
        return None
    merged = {"state": {}, "param_groups": [dict(g, params=[]) for g in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
        for group, theirs in zip(merged["param_groups"], part["param_groups"]):
            group["params"] += [n for n in theirs["params"] if n not in group["params"]]
    return merged


def own_optimizer_state(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The part of a whole model's optimizer state (by name) that this stage's parameters hold."""
    groups = [dict(g, params=[n for n in g["params"] if n in names]) for g in state["param_groups"]]
    return {"state": {n: s for n, s in state["state"].items() if n in names}, "param_groups": groups}


def _whole(t: Any) -> Any:
    """A DTensor gathered whole (every rank of its mesh calls it in the same order); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
