"""DTensor helpers shared by FSDP and TensorParallel: blocks and sharding, the mixed-precision
policy, the rank-0 broadcast, meta-device init, gradient norms, memory.

Everything here works on a mix of DTensor and plain tensors, because a module set up by FSDP2 or
``parallelize_module`` holds DTensors on one or more meshes next to plain replicated tensors.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.precision import Precision

__all__ = [
    "blocks_bottom_up",
    "broadcast_from_rank0",
    "clip_grad_norm",
    "drop_unreduced_gradients",
    "dtensor_box",
    "dtensor_boxes",
    "gathered_parameters",
    "local_part",
    "local_tensor",
    "meta_parameters",
    "model_state_bytes",
    "mp_policy",
    "parameter_names",
    "parameters_to_meta",
    "rebind_optimizer",
    "reduce_max",
    "repeated_blocks",
    "shard_bottom_up",
    "total_grad_norm",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (a view, not a copy), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


# ---- blocks, sharding, precision, rank 0's weights ----------------------------------------------------


def repeated_blocks(module: nn.Module) -> tuple[type, ...]:
    """The classes held in any ``nn.ModuleList`` of ``module`` (a transformer's layers), sorted by name.

    These are the units FSDP2 shards one by one, so only one block's parameters are whole at a time.
    """
    found = {type(child) for m in module.modules() if isinstance(m, nn.ModuleList) for child in m}
    return tuple(sorted(found, key=lambda c: c.__qualname__))


def blocks_bottom_up(module: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    """Submodules of ``module`` (not itself) that are instances of ``classes``, children before parents."""
    return [m for m in reversed(list(module.modules())) if m is not module and isinstance(m, classes)]


def shard_bottom_up(module: nn.Module, targets: list[nn.Module], **kwargs: Any) -> None:
    """``fully_shard`` each of ``targets`` (children before parents: FSDP2 needs bottom-up), then the root."""
    for sub in targets:
        fully_shard(sub, **kwargs)
    fully_shard(module, **kwargs)


def mp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy from a shardkit precision.

    FSDP2 casts the gathered parameters to the policy's param_dtype for compute, so the master weights
    stay in the precision's ``param_dtype`` (no cast when the two agree); gradients are reduced in its
    ``comm_dtype``. The Runner's autocast on top only touches the ops autocast lists.
    """
    compute = precision.compute_dtype if precision.compute_dtype != precision.param_dtype else None
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=precision.comm_dtype, cast_forward_inputs=True)


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's (whole, not yet sharded) module."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


# ---- meta-device construction -------------------------------------------------------------------


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    Parameters (the bulk of a model) take no memory; buffers stay real because many models compute
    them in ``__init__`` and have no method to recompute them (the Llama model's rotary
    ``inv_freq``). Tied parameters stay tied: registering a parameter that is already on the meta
    device keeps the same object.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def parameters_to_meta(module: nn.Module) -> None:
    """Replace every parameter by one on the meta device (tied ones stay tied), freeing its storage; buffers stay."""
    moved: dict[int, nn.Parameter] = {}
    originals = list(module.parameters())  # alive until the end, so that no id() is reused in the loop
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or p.is_meta:
                continue
            if id(p) not in moved:
                moved[id(p)] = type(p)(p.detach().to("meta"), requires_grad=p.requires_grad)
            m._parameters[name] = moved[id(p)]
    del originals


def has_meta_parameters(module: nn.Module) -> bool:
    return any(local_tensor(p).is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters of an already sharded module on ``device``; real buffers are kept."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


def initialize_parameters(module: nn.Module) -> None:
    """Run the model's own initialisation on freshly materialised (possibly sharded) parameters.

    The root's ``init_weights()`` or ``reset_parameters()`` when it has one (it knows the model's
    init, such as Llama's normal(0.02)), else every submodule's ``reset_parameters()``.
    """
    with torch.no_grad():
        for attr in ("init_weights", "reset_parameters"):
            if callable(getattr(module, attr, None)):
                getattr(module, attr)()
                return
        for sub in module.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()


# ---- whole parameters on demand -------------------------------------------------------------------


@contextlib.contextmanager
def gathered_parameters(params: list[torch.Tensor], modifier_rank: int | None = None,
                        module: nn.Module | None = None) -> Iterator[list[torch.Tensor]]:
    """Yield each of ``params`` as a plain whole tensor (DTensors gathered, one full copy per tensor).

    With ``module``, its attributes holding these parameters point at whole ``nn.Parameter`` views of
    the gathered tensors inside the block (so ``module.parameters()`` reads whole weights there) and
    are put back on exit. With ``modifier_rank=r``, rank r's whole tensors are broadcast on exit and each
    rank keeps its shard of them; otherwise writes are dropped. Do not run forward inside the block.
    """
    whole: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for p in params:
            if id(p) not in whole:
                whole[id(p)] = p.full_tensor() if isinstance(p, DTensor) else p
    swapped = _swap_in(module, params, whole) if module is not None else []
    try:
        yield [whole[id(p)] for p in params]
    finally:
        for sub, name, original in swapped:
            sub._parameters[name] = original
        if modifier_rank is not None:
            _keep_writes(params, whole, modifier_rank)


def _swap_in(module: nn.Module, params: list[torch.Tensor], whole: dict[int, torch.Tensor]) -> list:
    wanted = {id(p) for p in params if isinstance(p, DTensor)}
    views: dict[int, nn.Parameter] = {}
    swapped = []
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and id(p) in wanted:
                if id(p) not in views:  # tied parameters stay one object
                    views[id(p)] = nn.Parameter(whole[id(p)], requires_grad=p.requires_grad)
                swapped.append((sub, name, p))
                sub._parameters[name] = views[id(p)]
    return swapped


def dtensor_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, shape)`` of this rank's local shard of ``t`` in the global tensor.

    Raises:
        ValueError: the shard is several boxes (:func:`dtensor_boxes`): one box would silently be the wrong data.
    """
    boxes = dtensor_boxes(t)
    if len(boxes) != 1:
        raise ValueError(f"a DTensor placed {t.placements} holds {len(boxes)} boxes of its global tensor on this rank, "
                         "not one: read it with dtensor_boxes / local_part")
    return boxes[0][0], boxes[0][1]


Box = tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]]


def _lone_strided(t: DTensor) -> list[tuple[int, Any]]:
    """(mesh dim, placement) of each ``_StridedShard`` with ``split_factor > 1`` that is the only placement splitting
    its tensor dimension: its shard is ``split_factor`` separate row blocks (as tensor parallelism inside the experts
    splits a stacked gate/up weight), which torch's single offset cannot describe."""
    out = []
    for i, p in enumerate(t.placements):
        if isinstance(p, _StridedShard) and p.split_factor > 1 and not any(
                j != i and getattr(q, "dim", None) == p.dim and not isinstance(q, Replicate)
                for j, q in enumerate(t.placements)):
            out.append((i, p))
    return out


def dtensor_boxes(t: DTensor) -> list[Box]:
    """This rank's local shard of ``t`` as boxes of the global tensor: ``(offsets, shape, index)``, ``index`` the
    box's place in the local tensor (``local[index]``). One box for Shard/Replicate placements (torch's own offset);
    a lone ``_StridedShard(d, split_factor=k)`` over ``n`` ranks holds, on coordinate ``c``, the ``c``-th of ``n``
    blocks of each of the ``k`` equal parts of dimension ``d``: ``k`` boxes (none on a rank outside the mesh).

    Raises:
        ValueError: a lone strided dimension that ``k x n`` does not divide (its shards would be uneven).
    """
    strided = _lone_strided(t)
    coord = t.device_mesh.get_coordinate()
    if strided and coord is None:
        return []
    placements = list(t.placements)
    for i, _ in strided:
        placements[i] = Replicate()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
    runs: list[list[tuple[int, int, int]]] = [[(int(o), int(s), 0)] for o, s in zip(offsets, shape)]
    for i, p in strided:
        size, n, k = t.shape[p.dim], t.device_mesh.size(i), p.split_factor
        if size % (k * n):
            raise ValueError(f"a DTensor of shape {list(t.shape)} placed {t.placements}: dimension {p.dim} ({size}) % "
                             f"(split_factor {k} x {n} ranks) != 0; the strided shards would be uneven")
        piece = size // (k * n)
        runs[p.dim] = [(part * (size // k) + coord[i] * piece, piece, part * piece) for part in range(k)]
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo),
             tuple(slice(r[2], r[2] + r[1]) for r in combo)) for combo in itertools.product(*runs)]


def local_part(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that ``t`` (a DTensor, or plain and whole) holds, shaped like its local
    shard (a view where it is one box)."""
    if not isinstance(t, DTensor):
        return full
    boxes = dtensor_boxes(t)
    if len(boxes) == 1:
        offsets, shape, _ = boxes[0]
        return full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
    out = full.new_empty(local_tensor(t).shape)
    for offsets, shape, index in boxes:
        out[index] = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
    return out


@torch.no_grad()
def _keep_writes(params: list[torch.Tensor], whole: dict[int, torch.Tensor], src: int) -> None:
    done: set[int] = set()
    for p in params:
        if id(p) in done:
            continue
        done.add(id(p))
        full = whole[id(p)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(full, src=src)
        if isinstance(p, DTensor):
            local_tensor(p).copy_(local_part(full, p))


# ---- optimizers -----------------------------------------------------------------------------------


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` before a module is sharded (tied parameters map to their first name)."""
    return {id(p): name for name, p in module.named_parameters()}


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point an optimizer built over a module's parameters at the parameters that replaced them.

    FSDP2 and ``parallelize_module`` swap each parameter for a new DTensor parameter of the same name,
    so an optimizer built before ``setup()`` holds stale ones; it is rebound by name.

    Raises:
        ValueError: the optimizer already has state (it stepped before setup), or holds a parameter
            that is not the module's.
    """
    if optimizer.state:
        raise ValueError("the optimizer already has state (it stepped before runner.setup()); set up the model and "
                         "optimizer before the first step, or build the optimizer after setup")
    live = dict(module.named_parameters())
    for gi, group in enumerate(optimizer.param_groups):
        rebound = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in live:
                raise ValueError(f"optimizer param_groups[{gi}] holds a parameter of shape {list(p.shape)} that is "
                                 f"not in {type(module).__name__}; build the optimizer over model.parameters()")
            rebound.append(live[name])
        group["params"] = rebound


# ---- gradients ------------------------------------------------------------------------------------


def total_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total ``norm_type`` norm over gradients that may be shards on several meshes.

    Gradients are grouped by mesh and placements so that each group is one fused norm and one
    collective; the result is a plain 0-dim fp32 tensor, equal on every rank.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for key, members in groups.items():
        part = torch.nn.utils.get_total_norm(members, norm_type, foreach=None)
        if isinstance(part, DTensor):
            part = part.full_tensor()
        norms.append(part.float())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``params`` (DTensor or not) to a total norm of ``max_norm``; return the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # NOTE: scaling is elementwise, so each rank scales its local shard; no DTensor dispatch needed.
    locals_ = [local_tensor(g) for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in locals_:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        torch._foreach_mul_(ts, coef.to(device))
    return total


def drop_unreduced_gradients(module: nn.Module) -> None:
    """Drop the gradients the FSDP2 units in ``module`` hold unsharded after backwards with gradient sync off (the
    non-final micro-batches of an accumulation window): ``optimizer.zero_grad`` reaches only the sharded ones, so an
    abandoned window's would otherwise be reduced into the next window's."""
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None  # set when gradients accumulate in the reduce dtype
                if hasattr(param, "_unsharded_param"):
                    param._unsharded_param.grad = None


def reduce_max(flag: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """MAX of a 0/1 flag over ``group`` (default: every rank) as a plain tensor."""
    if isinstance(flag, DTensor):
        flag = flag.full_tensor()
    flag = flag.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


# ---- memory ---------------------------------------------------------------------------------------


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only).

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ..., "total": ...}``; tied parameters count once.
    """
    seen: set[int] = set()
    params = grads = 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += _nbytes(p)
        if p.grad is not None:
            grads += _nbytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _nbytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()
