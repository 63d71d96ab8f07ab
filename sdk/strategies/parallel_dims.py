"""One device mesh for every parallel dimension: sizes, validation with named errors, the DeviceMesh.

    from shardkit.strategies.parallel_dims import ParallelDims
    dims = ParallelDims(dp_shard=2, cp=2).resolve(world_size=4)
    dims.validate(num_heads=8, num_layers=4, seq_len=512, cp_mode="ulysses")
    mesh = dims.build("cpu")                # dims named ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    mesh["cp"], dims.submesh(mesh, ("dp_shard", "cp"))  # one dimension, or several flattened into one
    ParallelDims(ep=2).resolve(4).build_expert("cpu")["ep"]  # expert parallelism: groups of 2 inside dp_shard

The order is pp outermost, tp innermost (torchtitan's): tensor-parallel peers are neighbouring ranks, so
on a node their all-reduces stay on the fastest links, and each pipeline stage is a contiguous block.
Accelerate's ``parallelism_config`` section reads into it (:meth:`ParallelDims.from_accelerate`).

``ep`` (expert parallelism) is not a factor of the world: it borrows ranks from ``dp_shard x cp`` (torchtitan's
rule). Ranks that see different batches, or different chunks of the same sequences, also hold different experts of
each MoE layer, and their tokens travel to the experts' ranks; :meth:`ParallelDims.build_expert` gives the mesh with
``dp_shard`` split into ``("dp_shard_mod_ep", "ep")``, ep innermost so that an expert group is neighbouring ranks.
With context parallelism ep takes every cp rank and ``ep / cp`` of the dp_shard ranks (ep must be a multiple of cp
and divide ``dp_shard * cp``): ``dp_shard`` splits into ``("dp_shard_mod_ep", "dp_shard_in_ep")`` and ``ep`` is
``dp_shard_in_ep x cp`` flattened, so the cp ranks that hold one sequence's chunks split the experts between them.
When ep is smaller than the ranks it borrows from, each expert is held by ``dp * cp / ep`` ranks
(:attr:`ParallelDims.expert_replicas`: the ``dp_replicate x dp_shard_mod_ep`` ranks with the same ep coordinate),
which average its gradient.
With tensor parallelism (torchtitan's default, expert tensor parallel degree 1) ep borrows the tp ranks too: ``ep``
is ``dp_shard_in_ep x cp x tp`` flattened, a multiple of ``cp * tp`` dividing ``dp_shard * cp * tp``; the tp peers
(same batch) hold different experts and each dispatches its share of the tokens
(:mod:`shardkit.strategies.ep_tensor`). With ``expert_tp`` (torchtitan's etp = tp) ep borrows from ``dp_shard x cp``
only and the tp peers, which hold the same experts, split each expert's matrices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardkit.utils.suggest import did_you_mean

__all__ = ["ACCELERATE_KEYS", "DIM_NAMES", "ParallelDims", "strategy_spec_from_accelerate"]

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Accelerate's own keys, and shardkit's ``parallelism_config_ep_size`` and ``parallelism_config_pp_size``
# (Accelerate's ParallelismConfig has neither ep nor pp).
ACCELERATE_KEYS = {f"parallelism_config_{n}_size": n for n in ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp")}
CP_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions; their product is the world size.

    Args:
        dp_replicate: replicas of the model whose gradients are all-reduced (DDP-like).
        dp_shard: ranks that shard parameters, gradients and optimizer state (FSDP); -1: whatever the
            other sizes leave of the world (set by :meth:`resolve`).
        cp: ranks that split each sequence (context parallelism).
        tp: ranks that split each layer's matrices (tensor parallelism).
        pp: pipeline stages (each a block of layers).
        ep: ranks that split each MoE layer's experts; borrowed from dp_shard (must divide it), or from dp_shard x cp
            under context parallelism (a multiple of cp dividing dp_shard * cp), or from dp_shard x tp under tensor
            parallelism (a multiple of tp dividing dp_shard * tp), so not a factor of the world size.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    expert_tp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.expert_tp, bool):
            raise ValueError(f"ParallelDims expert_tp={self.expert_tp!r} must be True or False")
        for name in (*DIM_NAMES, "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and
                                                                         not (name == "dp_shard" and value == -1)):
                allowed = ">= 1 or -1 (the rest of the world)" if name == "dp_shard" else ">= 1"
                raise ValueError(f"ParallelDims {name}={value!r} must be an int {allowed}")

    @property
    def sizes(self) -> dict[str, int]:
        """Dimension name -> size, in mesh order (pp outermost, tp innermost)."""
        return {n: getattr(self, n) for n in DIM_NAMES}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def dp(self) -> int:
        """Ranks that see different batches: dp_replicate * dp_shard (cp, tp and pp peers share one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: dp_replicate * dp_shard * cp * tp / ep (the ranks ep borrows from, over
        ep)."""
        return self.dp * self.cp * (1 if self.expert_tp else self.tp) // self.ep

    def _product(self) -> str:
        return " * ".join(f"{n}({s})" for n, s in self.sizes.items() if n != "pp" or s > 1)

    def resolve(self, world_size: int) -> ParallelDims:
        """These sizes with ``dp_shard=-1`` filled from ``world_size``; checks the product equals it.

        Raises:
            ValueError: the product is not ``world_size`` (the message shows every factor), or the other
                sizes do not divide it.
        """
        dims = self
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp * self.tp * self.pp
            if world_size % rest:
                raise ValueError(f"ParallelDims: world_size({world_size}) is not divisible by dp_replicate"
                                 f"({self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {rest}; "
                                 "choose sizes whose product divides the world size")
            dims = dataclasses.replace(self, dp_shard=world_size // rest)
        if dims.world_size != world_size:
            raise ValueError(f"ParallelDims: {dims._product()} = {dims.world_size} != world_size({world_size}); "
                             "the sizes must multiply to the number of processes (set dp_shard=-1 to fill the rest)")
        if dims.ep > 1 and dims.tp > 1 and not dims.expert_tp:
            inner = dims.cp * dims.tp
            if dims.ep % inner or (dims.dp_shard * inner) % dims.ep:
                raise ValueError(f"ParallelDims: ep({dims.ep}) with tp({dims.tp}): expert parallelism borrows every "
                                 f"tp{' and cp' if dims.cp > 1 else ''} rank and some dp_shard({dims.dp_shard}) ranks "
                                 f"(each tp rank dispatches its share of the tokens), so ep must be a multiple of "
                                 f"{inner} that divides dp_shard * {'cp * ' if dims.cp > 1 else ''}tp = "
                                 f"{dims.dp_shard * inner}; e.g. ep={inner}")
        elif dims.ep > 1 and dims.cp > 1:
            if dims.ep % dims.cp or (dims.dp_shard * dims.cp) % dims.ep:
                raise ValueError(f"ParallelDims: ep({dims.ep}) with cp({dims.cp}): expert parallelism borrows every "
                                 f"cp rank and some dp_shard({dims.dp_shard}) ranks (ep = dp_shard_in_ep * cp), so ep "
                                 f"must be a multiple of cp({dims.cp}) that divides dp_shard * cp = "
                                 f"{dims.dp_shard * dims.cp}; e.g. ep={dims.cp}")
        elif dims.dp_shard % dims.ep:
            raise ValueError(f"ParallelDims: dp_shard({dims.dp_shard}) % ep({dims.ep}) != 0: expert parallelism "
                             "splits the experts over groups of ep data-parallel (dp_shard) ranks; choose an ep that "
                             f"divides {dims.dp_shard}")
        return dims

    def validate_experts(self, num_experts: int) -> None:
        """Each expert-parallel rank holds ``num_experts / ep`` whole experts of every MoE layer.

        Raises:
            ValueError: ep does not divide ``num_experts``.
        """
        if num_experts % self.ep:
            raise ValueError(f"num_experts({num_experts}) % ep({self.ep}) != 0: each expert-parallel rank holds "
                             "whole experts; pick an ep that divides the number of experts")

    def validate(self, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                 num_layers: int | None = None, seq_len: int | None = None, cp_mode: str = "ring",
                 layer_split: tuple[int, ...] | None = None) -> None:
        """Check that a model and its sequences fit these sizes; each failure names the numbers and a fix.

        Args:
            num_heads, num_kv_heads: attention heads (tp must divide both; Ulysses cp must divide num_heads
                per tp rank).
            num_layers: decoder layers (pp must divide them unless ``layer_split`` gives the stages' sizes).
            seq_len: tokens per sequence (context parallelism's causal load balancing splits it into
                2 * cp equal chunks).
            cp_mode: "ring" or "ulysses".
            layer_split: layers per pipeline stage, summing to ``num_layers``.
        """
        if cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode={cp_mode!r} is not one of {CP_MODES}{did_you_mean(str(cp_mode), CP_MODES)}")
        for what, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if heads is not None and heads % self.tp:
                raise ValueError(f"{what}({heads}) % tp({self.tp}) != 0: each tensor-parallel rank needs whole "
                                 "attention heads; pick a tp that divides the head counts")
        if num_heads is not None and self.cp > 1 and cp_mode == "ulysses" and (num_heads // self.tp) % self.cp:
            local = f"the {num_heads // self.tp} heads each tp rank holds" if self.tp > 1 else "the heads"
            raise ValueError(f"num_heads({num_heads}) / tp({self.tp}) % cp({self.cp}) != 0: Ulysses gives each "
                             f"context-parallel rank whole heads; use cp_mode='ring' (any head count) or a cp that "
                             f"divides {local}")
        if seq_len is not None and self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(f"seq_len({seq_len}) % (2 * cp({self.cp})) != 0: causal load balancing splits each "
                             f"sequence into {2 * self.cp} equal chunks; pad sequences to a multiple of {2 * self.cp}")
        self._validate_layers(num_layers, layer_split)

    def _validate_layers(self, num_layers: int | None, layer_split: tuple[int, ...] | None) -> None:
        if layer_split is not None:
            if len(layer_split) % self.pp or any(n < 1 for n in layer_split):
                raise ValueError(f"layer_split={tuple(layer_split)} has {len(layer_split)} stages; it needs a "
                                 f"multiple of pp({self.pp}) stages of at least one layer each")
            if num_layers is not None and sum(layer_split) != num_layers:
                raise ValueError(f"layer_split={tuple(layer_split)} sums to {sum(layer_split)} != "
                                 f"num_layers({num_layers})")
        elif num_layers is not None and num_layers % self.pp:
            raise ValueError(f"num_layers({num_layers}) % pp({self.pp}) != 0: give each stage's layer count with "
                             f"layer_split=(...) summing to {num_layers}, or a pp that divides it")

    def build(self, device_type: str, names: Mapping[str, str] | None = None) -> Any:
        """The DeviceMesh over every rank of the default group, dimensions named as :data:`DIM_NAMES`.

        Args:
            names: dimension name -> the name the mesh gives it instead (FSDP's public ``"replicate"`` and
                ``"shard"`` for ``dp_replicate`` and ``dp_shard``).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size() if dist.is_initialized() else 1
        self.resolve(world)
        renamed = tuple((names or {}).get(n, n) for n in DIM_NAMES)
        return init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=renamed)

    def build_expert(self, device_type: str) -> Any:
        """The DeviceMesh of expert parallelism over every rank: :data:`DIM_NAMES` with ``dp_shard`` split into
        ``("dp_shard_mod_ep", "ep")`` (its own process groups, beside :meth:`build`'s). With cp > 1 or tp > 1,
        ``dp_shard`` splits into ``("dp_shard_mod_ep", "dp_shard_in_ep")`` and ``mesh["ep"]`` is ``dp_shard_in_ep x
        cp`` (``x tp``) flattened (the mesh itself keeps ``cp`` and ``tp`` as dimensions)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size() if dist.is_initialized() else 1
        dims = self.resolve(world)
        # the cp (and, without expert_tp, tp) ranks ep takes besides dp_shard ranks
        borrowed = dims.cp * (1 if dims.expert_tp else dims.tp) if dims.ep > 1 else 1
        inner = "ep" if borrowed == 1 else "dp_shard_in_ep"
        names, sizes = [], []
        for name, size in dims.sizes.items():
            if name == "dp_shard":
                names += ["dp_shard_mod_ep", inner]
                sizes += [size * borrowed // dims.ep, dims.ep // borrowed]
            else:
                names.append(name)
                sizes.append(size)
        mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        if borrowed > 1:
            mesh[(inner, "cp") if dims.tp == 1 or dims.expert_tp else (inner, "cp", "tp")]._flatten("ep")
        return mesh

    @classmethod
    def data_parallel(cls, world_size: int, shard_size: int, owner: str = "ParallelDims",
                      name: str = "dp_shard") -> ParallelDims:
        """Data parallelism over the whole world: groups of ``shard_size`` ranks shard (``dp_shard``) and the
        ``world_size / shard_size`` groups replicate (``dp_replicate``), as FSDP's sharding modes need.

        Args:
            owner, name: who asks and what its users call ``shard_size``, named in the error (FSDP's
                ``hybrid_shard_size``).

        Raises:
            ValueError: ``shard_size`` is not a whole number >= 1 that divides ``world_size``.
        """
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"{owner}: {name}={shard_size!r} must be an int >= 1")
        if world_size % shard_size:
            raise ValueError(f"{owner}: world_size({world_size}) % {name}({shard_size}) != 0: the ranks split into "
                             f"shard groups of {name} ranks each; choose a {name} that divides the world size "
                             "(e.g. the processes per node)")
        return cls(dp_replicate=world_size // shard_size, dp_shard=shard_size).resolve(world_size)

    @staticmethod
    def submesh(mesh: Any, names: tuple[str, ...]) -> Any:
        """One dimension of ``mesh``, or several (adjacent, in mesh order) flattened into one named ``a_b``."""
        if len(names) == 1:
            return mesh[names[0]]
        return mesh[names]._flatten("_".join(names))

    @classmethod
    def from_accelerate(cls, section: Mapping[str, Any], where: str) -> ParallelDims:
        """Sizes from Accelerate's YAML ``parallelism_config`` section (``parallelism_config_<dim>_size`` keys).

        Raises:
            ValueError: an unknown key (with the closest known one) or a size that is not a whole number >= 1.
        """
        sizes: dict[str, int] = {}
        for key, value in section.items():
            if key not in ACCELERATE_KEYS:
                raise ValueError(f"parallelism_config.{key} in {where} is not a known key"
                                 f"{did_you_mean(str(key), list(ACCELERATE_KEYS))}; known: {sorted(ACCELERATE_KEYS)}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallelism_config.{key}: {value!r} in {where} must be a whole number >= 1")
            sizes[ACCELERATE_KEYS[key]] = value
        return cls(**sizes)


def strategy_spec_from_accelerate(section: Any, world_size: int, distributed_type: str,
                                  where: str) -> tuple[str, dict[str, Any]]:
    """The strategy (registry name, keyword arguments) an Accelerate ``parallelism_config`` section describes.

    pp > 1 (shardkit's ``parallelism_config_pp_size``): Pipeline over pp stages, FSDP2 over each stage's dp_shard
    ranks, and with ep > 1 its ``ep_size``: each stage's experts split over ep of them (EP x PP); with dp_replicate,
    cp or tp it is refused by name.
    ep > 1 (shardkit's ``parallelism_config_ep_size``): ExpertParallel (experts split over ep ranks borrowed from
    dp_shard, FSDP2 over the data-parallel ranks, HSDP over dp_replicate; with cp > 1 its ``cp_size``: sequences split
    over cp, ep borrowed from dp_shard x cp; with tp > 1 its ``tp_size``: dense layers split over tp, ep borrowed from
    dp_shard x tp; with both, each: ep borrowed from dp_shard x cp x tp); with pp it is refused (not built).
    cp > 1: ContextParallel (FSDP2 over dp_shard x cp, HSDP over dp_replicate; with tp > 1 too, CP x TP: its
    ``tp_size``); tp > 1 alone: TensorParallel (FSDP2 over the data-parallel ranks); data parallelism only: FSDP
    (hybrid when dp_replicate > 1).

    Raises:
        ValueError: a bad key or size, sizes whose product is not the world size, or tp with dp_replicate but no cp.
    """
    if not isinstance(section, Mapping):
        raise ValueError(f"parallelism_config in {where} must be a section (a mapping), not {type(section).__name__}")
    if distributed_type not in ("FSDP", "MULTI_GPU", "MULTI_CPU", "NO"):
        raise ValueError(f"parallelism_config in {where} goes with distributed_type: FSDP (as Accelerate's ND "
                         f"parallelism does), not {distributed_type}")
    dims = ParallelDims.from_accelerate(section, where)
    try:
        dims = dims.resolve(world_size)
    except ValueError as err:
        raise ValueError(f"parallelism_config in {where}: {err}") from None
    if dims.pp > 1:
        return _pipeline_spec(dims, where)
    if dims.ep > 1:
        return "ep", {"ep_size": dims.ep, **({"dp_replicate": dims.dp_replicate} if dims.dp_replicate > 1 else {}),
                      **({"cp_size": dims.cp} if dims.cp > 1 else {}), **({"tp_size": dims.tp} if dims.tp > 1 else {})}
    if dims.cp > 1:
        return "cp", {"cp_size": dims.cp, "dp_replicate": dims.dp_replicate, **({"tp_size": dims.tp} if dims.tp > 1
                                                                                 else {})}
    if dims.tp > 1:
        if dims.dp_replicate > 1:
            raise ValueError(f"parallelism_config in {where}: tp({dims.tp}) with dp_replicate({dims.dp_replicate}) "
                             "is not supported; shard the data-parallel ranks instead (dp_shard)")
        return "tp", {"tp_size": dims.tp, **({"dp": "fsdp"} if dims.dp_shard > 1 else {})}
    if dims.dp_replicate > 1:
        return "fsdp", {"sharding": "hybrid" if dims.dp_shard > 1 else "none",
                        **({"hybrid_shard_size": dims.dp_shard} if dims.dp_shard > 1 else {})}
    return "fsdp", {}


def _pipeline_spec(dims: ParallelDims, where: str) -> tuple[str, dict[str, Any]]:
    """Pipeline's (registry name, keyword arguments) for resolved sizes with pp > 1."""
    others = [f"{n}({getattr(dims, n)})" for n in ("dp_replicate", "cp", "tp") if getattr(dims, n) > 1]
    if others:
        raise ValueError(f"parallelism_config in {where}: pp({dims.pp}) with {' and '.join(others)} is not "
                         "supported: a pipeline composes with dp_shard (FSDP2 over each stage's ranks) and ep only; "
                         "drop the other sizes, or parallelism_config_pp_size")
    if dims.dp_shard == 1:
        return "pp", {"pp_size": dims.pp}
    return "pp", {"pp_size": dims.pp, "dp": "fsdp", **({"ep_size": dims.ep} if dims.ep > 1 else {})}
