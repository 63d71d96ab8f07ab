"""Tensor parallel on DTensor ``parallelize_module``, alone or composed with FSDP2 as 2-D (data x tensor).

The mesh is ``("dp_replicate", "dp_shard", "tp")``, cut from the one validated
:class:`~shardkit.strategies.parallel_dims.ParallelDims` mesh (``strategy.dims``, ``strategy.world_mesh``): TP runs
inside each group of ``tp_size`` consecutive ranks; across groups the model is either sharded by FSDP2
(``dp="fsdp"``) or replicated with gradients all-reduced (``dp="replicate"``, FSDP2 with shard groups of one rank).

A plan (module name or fnmatch pattern -> ``ParallelStyle``) says how each layer is split. It comes from
``TensorParallel(plan=...)`` when given, else from the model's ``parallel_plan(tp_size, sequence_parallel)``
method, kept beside the model (shardkit's Llama: :func:`shardkit.models.llama_tp.llama_plan`); see
:func:`resolve_plan` and ``strategies/README.md``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from typing_extensions import override

from shardkit.strategies import _dtensor
from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily
from shardkit.strategies.parallel import MeshStrategy
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.utils.suggest import did_you_mean

__all__ = ["TensorParallel", "TensorParallelSettings", "hugging_face_plan", "resolve_plan", "validate_heads"]

DP_MODES = (None, "fsdp", "replicate")


@dataclass(frozen=True)
class TensorParallelSettings:
    """Settings of tensor parallelism.

    Args:
        tp_size: ranks that split each layer; must divide the world size. None (the default): every rank
            (pure TP), set when the Runner starts.
        plan: FQN pattern (fnmatch, e.g. ``"layers.*.mlp.up_proj"``) -> ParallelStyle; None: the model's own
            ``parallel_plan(tp_size, sequence_parallel)`` (shardkit's Llama has one). See :func:`resolve_plan`.
        sequence_parallel: shard the norms' activations along the sequence (passed to the model's
            ``parallel_plan``; with ``plan=...`` put SequenceParallel styles in the plan instead).
        dp: across TP groups: "fsdp" (2-D, FSDP2 shards over the data-parallel ranks), "replicate",
            or None ("replicate" when there is more than one TP group, else pure TP).
        state_dict_type: "sharded" (each rank writes its shards) or "full" (gathered to rank 0).
    """

    tp_size: int | None = None
    plan: dict[str, ParallelStyle] | None = field(default=None, hash=False)
    sequence_parallel: bool = False
    dp: str | None = None
    state_dict_type: str = "sharded"

    def __post_init__(self) -> None:
        if self.tp_size is not None and (isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int)
                                         or self.tp_size < 1):
            raise ValueError(f"TensorParallel tp_size={self.tp_size!r} must be an int >= 1")
        if self.dp not in DP_MODES:
            hint = did_you_mean(str(self.dp), [m for m in DP_MODES if m])
            raise ValueError(f"TensorParallel dp={self.dp!r} is not one of {DP_MODES}{hint}")
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"TensorParallel state_dict_type={self.state_dict_type!r} is not 'sharded' or 'full'")
        if self.plan is not None and self.sequence_parallel:
            raise ValueError("TensorParallel sequence_parallel=True applies to the model's own parallel_plan(); with "
                             "plan=..., put SequenceParallel() styles in the plan itself")

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) for ``world_size`` ranks (``tp_size`` None: all of them)."""
        if self.tp_size is None:
            return (1, 1, world_size)
        if world_size % self.tp_size:
            raise ValueError(f"TensorParallel: world_size({world_size}) % tp_size({self.tp_size}) != 0; "
                             f"use a tp_size that divides {world_size}")
        dp = world_size // self.tp_size
        return (1, dp, self.tp_size) if self.dp == "fsdp" else (dp, 1, self.tp_size)


def resolve_plan(module: nn.Module, plan: dict[str, ParallelStyle] | None, tp_size: int,
                 sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan TensorParallel applies to ``module``: module name -> ParallelStyle.

    ``plan`` (FQN patterns) when given, else the model's own ``parallel_plan(tp_size, sequence_parallel)``
    (shardkit's Llama has one, :func:`shardkit.models.llama_tp.llama_plan`), else a Hugging Face model's own plan
    (:func:`hugging_face_plan`). Patterns are expanded to the module names they match.

    Raises:
        ValueError: no plan was given and the model has no ``parallel_plan`` (the message names both fixes),
            or a pattern matches no module.
    """
    if plan is None:
        own = getattr(module, "parallel_plan", None)
        hf_plan = hugging_face_plan(module) if not callable(own) else None
        if not callable(own) and hf_plan is None:
            name = type(module).__name__
            raise ValueError(
                f"TensorParallel has no plan for {name}: pass TensorParallel(plan={{FQN pattern: ParallelStyle}}), "
                "e.g. {'layers.*.mlp.up_proj': ColwiseParallel(), 'layers.*.mlp.down_proj': RowwiseParallel()}, "
                f"or define {name}.parallel_plan(self, tp_size, sequence_parallel) returning one (as "
                "shardkit.models.llama.Llama does); see shardkit/strategies/README.md")
        if hf_plan is not None and sequence_parallel:
            raise ValueError(f"TensorParallel sequence_parallel=True: {type(module).__name__}'s own Hugging Face plan "
                             "(base_model_tp_plan) has no sequence-parallel form here; pass plan=... with "
                             "SequenceParallel() styles")
        plan = hf_plan if hf_plan is not None else own(tp_size, sequence_parallel)
    return _expand(plan, module)


def _hf_styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel,
        # the output gathered on every rank (a language model head's logits)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # an embedding split on the vocabulary: token ids come in whole, the looked-up rows are summed
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # a norm between a colwise and a rowwise layer (Qwen3's per-head q_norm/k_norm): its weight replicated, its
        # input each rank's own part (its heads). Seen as one tensor split on dim 0, the norm's op per row is the
        # same, and the replicated weight's gradient comes out summed over the ranks' parts, as it must.
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
    }


def hugging_face_plan(module: nn.Module, keep: Callable[[str, str], bool] | None = None
                      ) -> dict[str, ParallelStyle] | None:
    """A Hugging Face model's own plan (transformers' ``model.tp_plan``: the class's ``_tp_plan`` with the config's
    ``base_model_tp_plan`` under the base model's prefix) as ParallelStyles; None for a model without one.
    ``keep(key, style)``: which entries to map (None: all of them).

    Raises:
        ValueError: the plan names a style shardkit does not map (the key, the style and the fix are named).
    """
    plan = getattr(module, "tp_plan", None)  # transformers 5: every plan merged, keys from the root
    if not isinstance(plan, dict) or not plan:
        config_plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if not isinstance(config_plan, dict) or not config_plan:
            return None
        prefix = getattr(module, "base_model_prefix", "")
        inner = bool(prefix) and isinstance(getattr(module, prefix, None), nn.Module)
        plan = {**(getattr(type(module), "_tp_plan", None) or {}),
                **{(f"{prefix}.{k}" if inner else k): v for k, v in config_plan.items()}}
    styles = _hf_styles()
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if keep is not None and not keep(key, style):
            continue
        if style not in styles:
            raise ValueError(f"TensorParallel: {type(module).__name__}'s Hugging Face plan says {key!r}: {style!r}, a "
                             f"style shardkit does not map{did_you_mean(str(style), styles)} (it maps "
                             f"{sorted(styles)}); pass TensorParallel(plan={{...}}) with ParallelStyles instead")
        out[key] = styles[style]()
    return out


def _expand(plan: dict[str, ParallelStyle], module: nn.Module) -> dict[str, ParallelStyle]:
    """FQN patterns -> the module names they match; a pattern that matches nothing is an error."""
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"TensorParallel plan key {pattern!r} matches no module of {type(module).__name__}"
                             f"{did_you_mean(pattern, names)}")
        out.update({n: style for n in hits})
    return out


class TensorParallel(MeshStrategy):
    """DTensor tensor parallelism, optionally 2-D with FSDP2 over the data-parallel ranks.

    Ranks of one TP group must see the same batch: shard data by :attr:`data_parallel_rank` and
    :attr:`data_parallel_size`, not by rank and world size.

    Args:
        tp_size, plan, sequence_parallel, dp, state_dict_type: see :class:`TensorParallelSettings`.
        timeout: seconds a collective may wait before the job fails.
    """

    def __init__(self, tp_size: int | None = None, plan: dict[str, ParallelStyle] | None = None,
                 sequence_parallel: bool = False, dp: str | None = None, state_dict_type: str = "sharded",
                 timeout: float | None = None):
        super().__init__(timeout)
        self.settings = TensorParallelSettings(tp_size, plan, sequence_parallel, dp, state_dict_type)
        self.dims = ParallelDims(dp_shard=1, tp=tp_size or 1)  # resolved against the world in setup_environment
        self.world_mesh: Any = None

    @property
    def family(self) -> StrategyFamily:  # type: ignore[override]
        """FSDP with ``dp="fsdp"`` (FSDP2 shards the data-parallel ranks, as Accelerate's tp x dp_shard runs under
        FSDP); else the TP groups replicate, as torch collectives do under Accelerate's MULTI_GPU / MULTI_CPU."""
        return StrategyFamily.FSDP if self.settings.dp == "fsdp" else StrategyFamily.DATA_PARALLEL

    @override
    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """Each rank holds its 1/tp of the split weights and the rest whole; ``dp="fsdp"`` shards that over the
        data-parallel ranks too."""
        tp = job.tp_size or self.settings.tp_size or job.ranks_per_node
        split = job.tp_params if job.tp_params is not None else job.params
        held = job.share(split, tp) + (job.params - split)
        if self.settings.dp != "fsdp":
            return StateBytes.replicated(job, held)
        ways = max(1, job.ranks // tp)
        return StateBytes(job.share(held * job.param_bytes, ways), job.share(held * job.grad_bytes, ways),
                          job.share(held * job.optimizer_bytes, ways),
                          working=job.share(job.largest_layer, tp) * job.param_bytes)

    @property
    def data_parallel_size(self) -> int:
        """Number of TP groups: each sees its own part of the data."""
        return self.world_size // (self.settings.tp_size or self.world_size)

    @property
    def data_parallel_rank(self) -> int:
        """Index of this rank's TP group (ranks of one group share a batch)."""
        return self.rank // (self.settings.tp_size or self.world_size)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.settings.tp_size is None:  # strategy_from_name("tp"): TP over every rank
            self.settings = dataclasses.replace(self.settings, tp_size=self.world_size)
        replicate, shard, tp = self.settings.mesh_shape(self.world_size)  # validates before anything is built
        self.dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp).resolve(self.world_size)
        self.world_mesh = self.dims.build(self.device_type)
        self.mesh = self.world_mesh["dp_replicate", "dp_shard", "tp"]

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        s = self.settings
        validate_heads(module, self.dims)
        plan = resolve_plan(module, s.plan, s.tp_size, s.sequence_parallel)
        if _dtensor.has_meta_parameters(module):
            raise ValueError(f"TensorParallel: {type(module).__name__} has parameters on the meta device; TP splits "
                             "whole weights, so build the model with real ones (runner.init_module() does)")
        _dtensor.broadcast_from_rank0(module)  # every rank starts from rank 0's weights, the replicated ones included
        parallelize_module(module, self.tp_mesh, plan)
        if self.data_parallel_size > 1:
            blocks = _dtensor.blocks_bottom_up(module, _dtensor.repeated_blocks(module))
            _dtensor.shard_bottom_up(module, blocks, mesh=self.mesh["dp_replicate", "dp_shard"],
                                  mp_policy=_dtensor.mp_policy(self.precision), reshard_after_forward=s.dp == "fsdp")
        return module

    # ---- checkpoints -------------------------------------------------------------------------------

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(tp_size=self.settings.tp_size, dp=self.settings.dp, state_dict_type=self.settings.state_dict_type)
        return info

    def __repr__(self) -> str:
        return f"TensorParallel(tp_size={self.settings.tp_size}, dp={self.settings.dp!r}, device={self._device})"


def validate_heads(module: nn.Module, dims: ParallelDims) -> None:
    """Named errors for head counts tp does not divide (shardkit's LlamaConfig or an HF config), before the split."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
    if isinstance(heads, int):
        dims.validate(num_heads=heads, num_kv_heads=kv if isinstance(kv, int) else None)
