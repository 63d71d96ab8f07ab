"""Tensor parallel on DTensor ``parallelize_module``, alone or composed with FSDP2 as 2-D (data x tensor).

The mesh is ``("dp_replicate", "dp_shard", "tp")``: TP runs inside each group of ``tp_size``
consecutive ranks; across groups the model is either sharded by FSDP2 (``dp="fsdp"``) or replicated
with gradients all-reduced (``dp="replicate"``, FSDP2 with shard groups of one rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from typing_extensions import override

from shardkit.strategies import _mesh
from shardkit.strategies.base import param_list
from shardkit.strategies.distributed import MeshStrategy

__all__ = ["TensorParallel", "TensorParallelSettings", "llama_plan"]

DP_MODES = (None, "fsdp", "replicate")


@dataclass(frozen=True)
class TensorParallelSettings:
    """Settings of tensor parallelism.

    Args:
        tp_size: ranks that split each layer; must divide the world size. None (the default): every rank
            (pure TP), set when the Runner starts.
        plan: FQN pattern (fnmatch, e.g. ``"layers.*.mlp.up_proj"``) -> ParallelStyle; None uses the
            built-in plan for ``shardkit.models.llama.Llama``.
        sequence_parallel: shard the norms' activations along the sequence (built-in plan only).
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
            close = difflib.get_close_matches(str(self.dp), [m for m in DP_MODES if m], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"TensorParallel dp={self.dp!r} is not one of {DP_MODES}{hint}")
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"TensorParallel state_dict_type={self.state_dict_type!r} is not 'sharded' or 'full'")
        if self.plan is not None and self.sequence_parallel:
            raise ValueError("TensorParallel sequence_parallel=True applies to the built-in plan; with plan=..., put "
                             "SequenceParallel() styles in the plan itself")

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) for ``world_size`` ranks (``tp_size`` None: all of them)."""
        if self.tp_size is None:
            return (1, 1, world_size)
        if world_size % self.tp_size:
            raise ValueError(f"TensorParallel: world_size({world_size}) % tp_size({self.tp_size}) != 0; "
                             f"use a tp_size that divides {world_size}")
        dp = world_size // self.tp_size
        return (1, dp, self.tp_size) if self.dp == "fsdp" else (dp, 1, self.tp_size)


def llama_plan(model: nn.Module, tp_size: int, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan for ``shardkit.models.llama.Llama``: column-wise q/k/v/gate/up, row-wise o/down.

    Attention keeps ``num_heads / tp_size`` heads per rank (the model views its projections as
    ``(batch, seq, -1, head_dim)``, so local heads need no change). Embedding and the tied output head
    stay replicated. With ``sequence_parallel`` the norms and residual stream are sharded on the
    sequence dim between the blocks.

    Raises:
        ValueError: the head counts are not divisible by ``tp_size``.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers"):
        raise ValueError(f"TensorParallel has no built-in plan for {type(model).__name__}; pass plan={{FQN pattern: "
                         "ParallelStyle}}, e.g. {'layers.*.mlp.up_proj': ColwiseParallel()}")
    for what, heads in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads)):
        if heads % tp_size:
            raise ValueError(f"TensorParallel: {what}({heads}) % tp_size({tp_size}) != 0; each rank needs whole "
                             "attention heads")
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan["embed_tokens"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                   use_local_output=False)
        plan["norm"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(**out)
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel(**out)
        if sp:
            for norm in ("input_layernorm", "post_attention_layernorm"):
                plan[f"{p}.{norm}"] = SequenceParallel()
            for sub in ("self_attn", "mlp"):
                plan[f"{p}.{sub}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                        use_local_output=True)
    return plan


def _expand(plan: dict[str, ParallelStyle], module: nn.Module) -> dict[str, ParallelStyle]:
    """FQN patterns -> the module names they match; a pattern that matches nothing is an error."""
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"TensorParallel plan key {pattern!r} matches no module of {type(module).__name__}{hint}")
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
        self.mesh: DeviceMesh | None = None

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
        shape = self.settings.mesh_shape(self.world_size)  # validates before anything is built
        self.mesh = _mesh.build_mesh(self.device_type, shape, ("dp_replicate", "dp_shard", "tp"))

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        return super().module_init_context(empty_init)

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        names = _mesh.parameter_names(module)
        module = self.setup_module(self.precision.convert_module(module).to(self.root_device))
        if optimizer is not None:
            _mesh.rebind_optimizer(optimizer, names, module)
        return module, optimizer, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        s = self.settings
        plan = _expand(s.plan, module) if s.plan is not None else llama_plan(module, s.tp_size, s.sequence_parallel)
        if self.world_size > 1:
            with torch.no_grad():  # every rank starts from rank 0's weights, the replicated ones included
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, src=0)
        parallelize_module(module, self.tp_mesh, plan)
        if self.data_parallel_size > 1:
            dp_mesh = self.mesh["dp_replicate", "dp_shard"]
            p = self.precision
            mp = MixedPrecisionPolicy(param_dtype=p.compute_dtype if p.compute_dtype != p.param_dtype else None,
                                      reduce_dtype=p.comm_dtype)
            blocks = {type(c) for m in module.modules() if isinstance(m, nn.ModuleList) for c in m}
            for sub in reversed(list(module.modules())):
                if sub is not module and isinstance(sub, tuple(blocks)):
                    fully_shard(sub, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=s.dp == "fsdp")
            fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=s.dp == "fsdp")
        return module

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Context that yields ``params`` as plain whole tensors (DTensors gathered over their mesh).

        See :meth:`Strategy.gathered_parameters`; with ``modifier_rank=r`` rank r's writes are kept.
        """
        return _mesh.gathered_parameters(param_list(params), modifier_rank, module)

    # ---- checkpoints -------------------------------------------------------------------------------

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(tp_size=self.settings.tp_size, dp=self.settings.dp, state_dict_type=self.settings.state_dict_type)
        return info

    def __repr__(self) -> str:
        return f"TensorParallel(tp_size={self.settings.tp_size}, dp={self.settings.dp!r}, device={self._device})"
