"""Pipeline parallelism on ``torch.distributed.pipelining``: the model split by layer into stages over ``pp``
ranks, replicated (gradients all-reduced, as DDP) over the remaining data-parallel ranks.

The user's loop stays theirs::

    runner = Runner(Pipeline(pp_size=2, schedule="1f1b", microbatches=4))
    model, opt = runner.setup(Llama(cfg), opt)
    loss = model(x, labels=x)      # the whole pipeline schedule: forward AND backward of every micro-batch
    runner.backward(loss)          # nothing left to do (the schedule ran it); accumulation still counts
    runner.step()

``model(x, labels)`` splits the batch into micro-batches and runs the schedule; gradients are in place when
it returns, and the loss (the batch's token-weighted mean, on every rank) comes back detached. The stages keep
the model's own parameter names: rank k's ``model.state_dict()`` holds exactly its layers'.

Micro-batches: ``microbatches`` when given, else the Runner's accumulation window (``gradient_accumulation_steps``,
or a ``runner.begin_window`` size) when it is over 1, else ``pp_size``.

Data parallelism over the other ranks: ``dp="ddp"`` replicates each stage (gradients all-reduced), ``dp="fsdp"``
shards it with FSDP2 over ``dp_shard`` (each decoder layer, the output head and the stage are FSDP units). Either
way the gradients are reduced once per accumulation window, at its last ``model(...)`` call.

Expert parallelism inside the stages (``ep_size > 1``, with ``dp="fsdp"``): each stage's MoE experts are split over
``ep`` of the stage's ``dp_shard`` ranks with all-to-all token dispatch, the dense parameters FSDP2 over them (see
``ep_pipeline.py``)::

    Pipeline(pp_size=2, dp="fsdp", ep_size=2)
    # --strategy pp --strategy-opt pp_size=2 --strategy-opt dp=fsdp --strategy-opt ep_size=2

Models: shardkit's Llama (``embed_tokens``, ``layers``, ``norm``, ``lm_head``) and Hugging Face decoders of
model_type ``llama``, ``mixtral`` and ``qwen3_moe`` (``model(input_ids=x, labels=x).loss``); tied embeddings
included. An MoE Llama's auxiliary loss reaches the loss from every stage (each stage starts it in its own backward,
weighted as a micro-batch's share; the returned loss includes it); each micro-batch routes with its own statistics,
as under gradient accumulation. An HF MoE decoder's router aux loss (``output_router_logits``) is one function of
every layer's routers, so its stages send their routing sums on with the hidden states and the last stage starts it
(``_pipeline_hf_moe.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from shardkit import checkpoint as ckpt
from shardkit.strategies import _dtensor, ep_memory, ep_pipeline
from shardkit.strategies._pipeline_stages import (
    PipelineRunner,
    gather_optimizer_state,
    iter_full_state,
    own_optimizer_state,
)
from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily
from shardkit.strategies.parallel import ProcessGroupStrategy
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.pipeline_settings import (
    DATA_PARALLEL,
    SCHEDULES,
    PipelineSettings,
    bubble_fraction,
    stage_layers,
)

__all__ = ["DATA_PARALLEL", "SCHEDULES", "Pipeline", "PipelineSettings", "bubble_fraction", "stage_layers"]


class Pipeline(ProcessGroupStrategy):
    """Pipeline parallelism over ``pp_size`` ranks; DDP replication or FSDP2 sharding over the rest.

    Args:
        pp_size, schedule, microbatches, stages_per_rank, layer_split, dp: see :class:`PipelineSettings`.
        ep_size: ranks of each stage's ``dp_shard`` ranks that split its MoE layers' experts (expert parallelism,
            all-to-all token dispatch); it must divide dp_shard = world / pp_size and each layer's number of experts,
            and needs ``dp="fsdp"``. None or 1: the experts whole on every rank.
        timeout: seconds a collective may wait before the job fails.
    """

    def __init__(self, pp_size: int | None = None, schedule: str = "1f1b", microbatches: int | None = None,
                 stages_per_rank: int | None = None, layer_split: tuple[int, ...] | str | None = None,
                 dp: str = "ddp", timeout: float | None = None, ep_size: int | None = None):
        super().__init__(timeout)
        split = tuple(layer_split) if isinstance(layer_split, list) else layer_split
        self.settings = PipelineSettings(pp_size, schedule, microbatches, stages_per_rank, split, dp)
        ep = ep_pipeline.check_pipeline_experts(ep_size, self.settings.dp)
        self.dims = ParallelDims(pp=pp_size or 1, dp_replicate=1, ep=ep)
        self.mesh: Any = None
        self.expert_mesh: Any = None
        self._window = 1  # micro-batches in the Runner's current accumulation window (set_window)
        self._sync = True

    @property
    def family(self) -> StrategyFamily:  # type: ignore[override]
        """FSDP with ``dp="fsdp"`` (each stage's units are FSDP2-sharded over dp_shard); with ``dp="ddp"`` the
        replicas run torch collectives, what Accelerate runs its own pipeline (``prepare_pippy``) under: MULTI_GPU /
        MULTI_CPU. Accelerate has no pipeline type of its own."""
        return StrategyFamily.FSDP if self.sharded else StrategyFamily.DATA_PARALLEL

    @override
    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """Each pipeline rank holds its stages' layers, 1/pp of them: replicated over the other ranks as DDP does, or
        with ``dp="fsdp"`` sharded over them (``ep_size``: each stage's routed experts split over ep, then sharded
        over the ranks holding the same ones, so a rank's share is the same), the stage's units kept gathered from
        the first forward to the gradient reduction (:func:`~shardkit.strategies.ep_memory.pipeline_expert_working`)."""
        pp = job.pp_size or self.settings.pp_size or job.ranks_per_node
        held = job.share(job.params, pp)
        if not self.sharded:
            return StateBytes.replicated(job, held)
        ways = max(1, job.ranks // pp)
        ep = job.ep_size or self.dims.ep
        return StateBytes(job.share(held * job.param_bytes, ways), job.share(held * job.grad_bytes, ways),
                          job.share(held * job.optimizer_bytes, ways),
                          working=ep_memory.pipeline_expert_working(job, pp, ep))

    @property
    @override
    def data_parallel_size(self) -> int:
        return self.world_size // self.dims.pp

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.rank % self.data_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.data_parallel_size

    @override
    def set_runner_values(self, gradient_accumulation_steps: int | None = None,
                          micro_batch_size: int | None = None) -> None:
        if gradient_accumulation_steps is not None:
            self._window = gradient_accumulation_steps

    @override
    def set_window(self, size: int) -> None:
        """The schedule runs backward inside forward, so the loss's share of the window is fixed there: a short
        window (``runner.begin_window``) must be known before its forwards."""
        self._window = size

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        pp = self.settings.pp_size or self.world_size
        self.dims = dataclasses.replace(self.dims, pp=pp, dp_shard=-1).resolve(self.world_size)
        self.settings = dataclasses.replace(self.settings, pp_size=pp)
        self.mesh = self.dims.build(self.device_type)
        if self.dims.ep > 1:
            self.expert_mesh = self.dims.build_expert(self.device_type)

    @property
    def ep_size(self) -> int:
        """Ranks that split each stage's MoE experts (1: none)."""
        return self.dims.ep

    @property
    def sharded(self) -> bool:
        """Whether the stages are sharded with FSDP2 over dp_shard (``dp="fsdp"``)."""
        return self.settings.dp == "fsdp"

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        names: dict[int, list[str]] = {}  # every name of each parameter: a tied one may live on under either
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        module = self.precision.convert_module(module).to(self.root_device)
        module = self.setup_module(module)
        if optimizer is not None:
            if optimizer.state:
                raise ValueError("Pipeline: the optimizer already has state (it stepped before runner.setup()); set "
                                 "up the model and optimizer before the first step")
            live = dict(module.named_parameters())
            for group in optimizer.param_groups:  # the other stages' parameters live on other ranks
                kept = (next((live[n] for n in names.get(id(p), ()) if n in live), None) for p in group["params"])
                group["params"] = [p for p in kept if p is not None]
        return module, optimizer, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:

        if self.sharded and self.settings.pp_size == 1:
            raise ValueError("Pipeline(pp_size=1, dp='fsdp') is FSDP without a pipeline: use the FSDP strategy "
                             "(--strategy fsdp), or a pp_size over 1")
        if self.dims.ep > 1:
            ep_pipeline.check_model_experts(module, self.dims, self.is_global_zero)
        _dtensor.broadcast_from_rank0(module)
        self._runner = PipelineRunner(module, self.settings, self.mesh, self.root_device, self._loss_scale,
                                      self.precision.scale_loss, self._shard_stage if self.sharded else None)
        module._shardkit_pipeline = self._runner
        return module

    def _shard_stage(self, stage: nn.Module) -> None:
        """FSDP2 over dp_shard: each decoder layer, the output head (its loss runs outside the stage's forward,
        so it gathers its own weight) and the stage (embedding, norm) as units."""
        policy = _dtensor.mp_policy(self.precision)
        mesh = self.mesh["dp_shard"]
        units = [*stage.layers, *([stage.head] if stage.head is not None else [])]
        ignored: set[nn.Parameter] = set()
        if self.dims.ep > 1:  # the experts first: split over the ep group, left out of the dense units below
            ignored = ep_pipeline.shard_stage_experts(stage, self.dims, self.expert_mesh,
                                                      mesh.get_group(), policy)
        # Units kept whole from the first forward to the step's reduction (torchtitan's default under pipeline
        # parallelism), at the cost of the stage's whole weights held through the step: resharded after each forward,
        # a unit is gathered again for every micro-batch's forward and backward. Measured on pp 2 x dp_shard 2, 4
        # micro-batches (benchmarks/pipeline.py --dp-size 2 --dp fsdp): 1f1b 1.15x and interleaved_1f1b 1.11x the
        # step time of torch's stages kept whole. Zero-bubble's W pass needs them whole too (WindowStage): 48
        # all-gathers instead of 212 on pp rank 0 of its bubble benchmark runs (m 4 and 8, 4 steps each).
        _dtensor.shard_bottom_up(stage, units, mesh=mesh, mp_policy=policy, reshard_after_forward=False,
                                 ignored_params=ignored)

    def _loss_scale(self) -> tuple[int, bool]:
        return self._window, self._sync

    @override
    def backward(self, loss: torch.Tensor, module: nn.Module, accumulation_steps: int) -> None:
        """The schedule ran backward inside ``model(x, labels)``: nothing is left but to check it did."""
        if not getattr(loss, "_shardkit_pipeline_backward_done", False):
            raise RuntimeError("Pipeline: runner.backward(loss) takes the loss model(input_ids, labels=...) "
                               "returned (the pipeline schedule runs forward and backward together); a loss computed "
                               "outside the model cannot be back-propagated through the stages")

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        self._sync = enabled

    @override
    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """The gradients, and under ``dp="fsdp"`` those of an abandoned window that FSDP2 holds unsharded (each stage
        defers its reduction to the window's last call)."""
        super().zero_grad(optimizer, module)
        if self.sharded:
            for stage in self._runner.stages:
                _dtensor.drop_unreduced_gradients(stage.submod)

    @override
    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (each rank holds its stage's, whole or FSDP shards)."""
        self.precision.unscale_gradients(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # A tied embedding/head has a copy on the first stage and one on the last, both holding the summed gradient:
        # counted once (the first stage's), as the unsplit model's parameters() does. Counted twice, the tiny tied
        # Llama of tests/contract clipped by a norm 1.35x DDP's.
        copy = self._runner.module.lm_head.weight if self._tied_copy() else None
        counted = [p for p in params if p is not copy]
        norm = _stage_norm(counted, norm_type, self.mesh["pp"].get_group())
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            _dtensor.local_tensor(p.grad).mul_(scale)
        return norm

    def _tied_copy(self) -> tuple[str, str] | None:
        """(this rank's name for it, the unsplit model's name for it) where this rank holds the last stage's copy of a
        tied embedding/head weight and not the first stage's (which goes by the unsplit model's name); else None."""
        runner = self._runner
        if runner.tied_shape is None or not runner.last or runner.first:
            return None
        return runner.tied_keys

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> Any:
        """Not available: each rank holds other parameters (its stages'), so no list means the same on every rank;
        read the whole model with ``runner.iter_full_state_dict(model)`` or a checkpoint instead."""
        raise NotImplementedError("Pipeline: gathered_parameters needs the same parameters on every rank, but each "
                                  "pipeline rank holds only its stages'; use runner.iter_full_state_dict(model) (whole "
                                  "tensors on rank 0) or save a checkpoint")

    @override
    def iter_full_state_dict(self, module: nn.Module) -> Any:
        """The whole model's state dict on rank 0 in the unsplit model's key order, one tensor at a time."""

        return iter_full_state(self._runner, self.is_global_zero)

    # Checkpoints hold the whole model (rank 0 writes it, gathered tensor by tensor), so they load under any
    # pipeline size, pp 1 and the other strategies included; each stage loads the names it holds.

    @override
    def save_module(self, writer: ckpt.CheckpointWriter, name: str, module: nn.Module) -> None:
        state = dict(self.iter_full_state_dict(module))
        if self.is_global_zero:
            writer.write_tensors(name, state)

    @override
    def load_module(self, reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
        from shardkit.strategies._sharded_state import slice_full

        own = module.state_dict()
        if reader.entries().get(name) == "sharded":
            tensors = {k: t for k, t in reader.iter_full_tensors(name) if k in own}
        else:
            tensors = {k: t for k, t in reader.read_tensors(name).items() if k in own}
        if self._runner.tied_shape is not None:  # a tied weight may be stored under either name
            head, embed = self._runner.tied_keys
            for key, alias in ((head, embed), (embed, head)):
                if key in own and key not in tensors and alias in own and alias in tensors:
                    tensors[key] = tensors[alias]
        if not self.sharded:
            module.load_state_dict(tensors, strict=True)
            return
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ckpt.CheckpointError(f"{reader.path}: entry {name!r} has no {missing[:3]} ({len(missing)} of this "
                                       "stage's tensors missing); the model changed since the save")
        with torch.no_grad():
            for key, t in own.items():  # each rank keeps its FSDP shard of the whole tensor
                _dtensor.local_tensor(t).copy_(_dtensor.local_tensor(slice_full(tensors[key], t)))

    @override
    def save_optimizer(self, writer: ckpt.CheckpointWriter, name: str, optimizer: torch.optim.Optimizer,
                       module: nn.Module) -> None:

        state = ckpt.optimizer_state_by_name(optimizer, module)
        copy = self._tied_copy()
        if copy is not None:  # the first stage's copy steps alike (same summed gradient): saved once, as unsplit
            state = own_optimizer_state(state, set(dict(module.named_parameters())) - {copy[0]})
        merged = gather_optimizer_state(self._runner, state)
        if self.is_global_zero:  # the unsplit model's parameter order, whatever stages each rank holds
            order = {key: i for i, key in enumerate(self._runner.keys)}
            for group in merged["param_groups"]:
                group["params"].sort(key=lambda n: order.get(n, len(order)))
            writer.write_state(name, merged)

    @override
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, module: nn.Module, state: dict[str, Any]) -> None:
        """The whole model's state (the base ``load_optimizer`` reads any save so): this stage keeps its own."""
        from shardkit.strategies._sharded_state import slice_full

        params = dict(module.named_parameters())
        copy = self._tied_copy()
        if copy is not None:  # the last stage's copy of a tied weight loads the state saved under the unsplit name
            state = _with_alias(state, *copy)
        state = own_optimizer_state(state, set(params))
        if self.sharded:  # each rank keeps its FSDP shard of the whole tensors
            state["state"] = {n: {k: slice_full(v, params[n]) if isinstance(v, torch.Tensor) and v.dim() else v
                                  for k, v in st.items()} for n, st in state["state"].items()}
        ckpt.load_optimizer_state_by_name(optimizer, module, state)

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(pp_size=self.settings.pp_size, schedule=self.settings.schedule, dp=self.settings.dp)
        if self.dims.ep > 1:
            info.update(ep_size=self.dims.ep)
        return info

    def __repr__(self) -> str:
        ep = f", ep_size={self.dims.ep}" if self.dims.ep > 1 else ""
        return (f"Pipeline(pp_size={self.settings.pp_size}, schedule={self.settings.schedule!r}, "
                f"dp={self.settings.dp!r}{ep}, device={self._device})")


def _with_alias(state: dict[str, Any], alias: str, key: str) -> dict[str, Any]:
    """An optimizer state by name where parameter ``alias`` also holds ``key``'s state (and group), unless the
    checkpoint has its own entry for it (a save before the tied copy was saved once)."""
    if any(alias in g["params"] for g in state["param_groups"]):
        return state
    own = {alias: state["state"][key]} if key in state["state"] else {}
    return {"state": {**state["state"], **own},
            "param_groups": [dict(g, params=[*g["params"], alias]) if key in g["params"] else g
                             for g in state["param_groups"]]}


def _stage_norm(params: list[torch.Tensor], norm_type: float, group: Any) -> torch.Tensor:
    """The gradient norm over the whole model: each stage's norm (over its FSDP shards too) combined over the
    pipeline group."""
    local = _dtensor.total_grad_norm([p.grad for p in params], norm_type)
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = local ** norm_type
    dist.all_reduce(local, group=group)
    return local ** (1.0 / norm_type)
