"""ZeRO-3's parameters held gathered for one generate call, so decoding does not all-gather them per token.

A DeepSpeed engine's hooks gather a module's partitions before its forward and partition them again after it once no
submodule uses them any more (the parameter's ``ds_active_sub_modules`` is empty). A generate call runs one forward
per token, so by default every decoding step all-gathers the whole model, layer by layer. :func:`zero3_gathered`
gathers every partitioned parameter once (DeepSpeed's all-gather of a parameter list, as ``GatheredParameters``
does) and counts the call as one more user of each parameter for its duration, so that nothing partitions them
while it runs. On exit the parameters are partitioned again, as they were, so training goes on as if no generation
had run.

With every parameter whole, the engine's per-module hooks have nothing left to do but bookkeeping, and on a small
model that bookkeeping (four hooks per module and token, the parameter coordinator's trace) costs as much as the
forward itself. :func:`hooks_detached` takes them out of the modules' hook tables for the call and puts the very same
entries back, in their order, on exit. Unlike removing and registering them again (which renumbers the modules and
invalidates the engine's trace), the engine then sees nothing of the call: its coordinator, module ids and recorded
trace are exactly as the last training step left them. Hooks are detached only when every parameter is available
after the gather (one still in flight from a prefetch needs the hooks to wait for it).

When the whole model does not fit (the FSDP rule, :func:`shardkit.strategies._unshard.keep_gathered`), or
``keep_unsharded=False`` (TRL's ``ds3_gather_for_generation=False``), :func:`zero3_per_layer` gathers per layer
instead: the engine's hooks are detached all the same, and each layer of the model's stack (a child of its outermost
``nn.ModuleList``), and each other module owning partitioned parameters (the embedding, the output head), gathers its
partitioned parameters in one all-gather before its forward and partitions them again after it. The engine's hooks
would all-gather each leaf module's parameters separately (a Llama decoder layer: seven) with four Python hooks per
module and token; and since a generation forward differs from the training trace the engine recorded, they
invalidate that trace, so that the engine releases every parameter after its module and the next training step
records its trace again. Peak memory is one layer (or the embedding, or the head) gathered at a time.

The engine's own hooks (per module, as without this context) gather instead:
- under NVMe parameter offload (ZeROInfinity's default): DeepSpeed swaps partitions in through a fixed pool of
  ``buffer_count`` buffers along the recorded trace, one per parameter in flight, so the whole model cannot be
  swapped in at once (and a model put on NVMe is one that is not meant to be whole in memory);
- with ``stage3_module_granularity_threshold`` set: after a leaf module's forward the hooks then replace its
  parameters' data with an empty buffer whether or not someone still uses them;
- per layer, for a model without an ``nn.ModuleList`` of layers (nothing to gather layer by layer short of the whole
  model), or while a prefetch still has a parameter in flight (the engine's hooks wait for it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardkit.strategies._unshard import keep_gathered

__all__ = ["GENERATION_HOLDER", "hooks_detached", "per_layer", "per_layer_reason", "zero3_gathered",
           "zero3_per_layer"]

log = logging.getLogger("shardkit.inference")

# The name the call is counted under among a parameter's users (``ds_active_sub_modules`` holds the users' module ids,
# ints; a string cannot collide with one).
GENERATION_HOLDER = "shardkit.generate"


def _partitioned(module: nn.Module) -> list[nn.Parameter]:
    """The module's ZeRO-3 parameters that are partitioned now, in ``ds_id`` order (the same order on every rank, so
    the ranks' gathers match). Parameters already whole (persistent small ones, or one in flight) are left to the
    hooks."""
    params = {id(p): p for p in module.parameters()
              if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"}
    return sorted(params.values(), key=lambda p: p.ds_id)


def _gather_bytes(params: list[nn.Parameter], device: torch.device) -> int:
    """Bytes gathering adds on this rank: each whole parameter, less its partition where that already lives on
    ``device`` (an offloaded partition stays where it is)."""
    total = 0
    for p in params:
        total += p.ds_numel * p.element_size()
        local = p.ds_tensor
        if local is not None and local.device == device:
            total -= local.numel() * local.element_size()
    return total


def per_layer_reason(offload_params: str | None, granularity_threshold: int) -> str | None:
    """Why the parameters must stay per layer whatever the memory, or None."""
    if offload_params == "nvme":
        return ("parameters are offloaded to NVMe (DeepSpeed swaps them in through buffer_count buffers, a few "
                "parameters at a time)")
    if granularity_threshold > 0:
        return ("stage3_module_granularity_threshold is set (DeepSpeed's hooks then empty a leaf module's "
                "parameters after its forward even while they are held)")
    return None


def per_layer(reason: str, keep: bool | None) -> contextlib.AbstractContextManager[str]:
    """The engine's hooks alone (per layer) for a ``reason`` from :func:`per_layer_reason`.

    Raises:
        ValueError: ``keep=True``, which cannot be honoured.
    """
    if keep:
        raise ValueError(f"generate: keep_unsharded=True cannot hold ZeRO-3's parameters gathered: {reason}. "
                         "Leave keep_unsharded unset (per layer here), or offload parameters to the CPU instead")
    return contextlib.nullcontext(f"ZeRO-3 parameters gathered per layer in every forward ({reason})")


@contextlib.contextmanager
def zero3_gathered(module: nn.Module, device: torch.device, keep: bool | None, any_rank: Callable[[bool], bool],
                   fraction: float = 0.5, hooks: Iterable[RemovableHandle] = ()) -> Iterator[str]:
    """Hold every ZeRO-3 parameter of ``module`` gathered for the duration (one gather, then none per token); yields
    how parameters are handled, for the log.

    Args:
        keep: True/False forces the mode; None holds them when the extra bytes fit in ``fraction`` of the free memory
            on every rank.
        any_rank: the all-reduced "some rank says so", so that every rank takes the same decision.
        hooks: the engine's module hook handles, detached while the parameters are held (see
            :func:`hooks_detached`).
    """
    params = _partitioned(module)
    extra = _gather_bytes(params, device)
    if not keep_gathered(extra, device, keep, any_rank, fraction):
        why = ("keep_unsharded=False" if keep is False
               else f"holding them whole needs {extra / 2**20:.1f} MiB more per rank than fits on some rank")
        with zero3_per_layer(module, hooks) as how:
            log.info("generate: ZeRO-3 parameters are gathered per layer in every forward (%s; %s)", why, how)
            yield f"ZeRO-3 parameters gathered per layer in every forward ({why}; {how})"
        return
    log.info("generate: ZeRO-3 parameters gathered once for the call (%.1f MiB more per rank)", extra / 2**20)
    if params:
        params[0].all_gather(param_list=params)  # a collective: every rank has the same list (see _partitioned)
    for p in params:
        p.ds_active_sub_modules.add(GENERATION_HOLDER)
    try:
        # Each rank decides alone: whether hooks run changes no collective once every parameter is held.
        whole = all(p.ds_status.name == "AVAILABLE" for p in module.parameters() if hasattr(p, "ds_id"))
        with hooks_detached(hooks if whole else ()) as detached:
            yield ("ZeRO-3 parameters gathered once for the call"
                   + (", the engine's module hooks detached meanwhile" if detached else ""))
    finally:
        for p in params:
            p.ds_active_sub_modules.discard(GENERATION_HOLDER)
        # A call that failed inside a forward leaves that module's parameters in use: the engine releases those at
        # its next forward, and partitioning them here would free memory a module still points at.
        idle = [p for p in params if not p.ds_active_sub_modules and p.ds_status.name == "AVAILABLE"]
        if idle:
            idle[0].partition(param_list=idle, has_been_updated=False)


@contextlib.contextmanager
def hooks_detached(handles: Iterable[RemovableHandle]) -> Iterator[int]:
    """Take the hooks behind ``handles`` out of their modules' hook tables for the duration; yields how many.

    On exit every table gets back exactly the entries it had, in their order, so the hooks run as before and nothing
    was registered anew (a hook another caller added meanwhile stays, after them; one it removed stays removed).
    """
    tables: dict[int, tuple[dict, list]] = {}
    detached: set[int] = set()
    for handle in handles:
        table = handle.hooks_dict_ref()
        if table is None or handle.id not in table:
            continue
        if id(table) not in tables:
            tables[id(table)] = (table, list(table.items()))
        del table[handle.id]
        detached.add(handle.id)
    try:
        yield len(detached)
    finally:
        for table, before in tables.values():
            known = {key for key, _ in before}
            kept = [(key, hook) for key, hook in before if key in detached or key in table]
            added = [(key, hook) for key, hook in table.items() if key not in known]
            table.clear()
            table.update(kept)
            table.update(added)


def _layer_units(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The modules gathered one at a time in a forward, each with the partitioned parameters it gathers: every module
    outside the model's layers that owns partitioned parameters itself (an embedding, the output head) with those,
    then each child of the model's outermost ``nn.ModuleList`` (its stack of layers) with all of its own; in
    module order, the same on every rank. Empty for a model without a list of layers."""
    layers: list[nn.Module] = []
    inside: set[int] = set()

    def walk(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList):
                layers.extend(child)
                inside.update(id(m) for layer in child for m in layer.modules())
            else:
                walk(child)

    walk(module)
    if not layers:
        return []
    owners = [(m, _partitioned_own(m)) for m in module.modules() if id(m) not in inside]
    return [(m, params) for m, params in [*owners, *((layer, _partitioned(layer)) for layer in layers)] if params]


def _partitioned_own(module: nn.Module) -> list[nn.Parameter]:
    """The module's own (not its children's) ZeRO-3 parameters partitioned now."""
    return [p for p in module.parameters(recurse=False)
            if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"]


class _UnitGather:
    """The forward hooks of one unit: its partitioned parameters gathered in one all-gather before its forward and
    partitioned again after it (also after a forward that raised). A parameter another unit holds meanwhile (a tied
    embedding inside the output head's forward) is left to that unit."""

    def __init__(self, params: list[nn.Parameter], holder: str):
        self.params = sorted(params, key=lambda p: p.ds_id)  # ds_id order: the ranks' lists match
        self.holder = holder
        self.held: list[nn.Parameter] = []

    def gather(self, module: nn.Module, args: Any) -> None:
        todo = [p for p in self.params if p.ds_status.name == "NOT_AVAILABLE"]
        if todo:
            # one flat all-gather for the unit (all_gather would run one per parameter); a collective: every rank
            # runs the same forwards
            todo[0].all_gather_coalesced(todo).wait()
        for p in todo:
            p.ds_active_sub_modules.add(self.holder)
        self.held = todo

    def release(self, module: nn.Module, args: Any, output: Any) -> None:
        held, self.held = self.held, []
        for p in held:
            p.ds_active_sub_modules.discard(self.holder)
        # persistent parameters (under stage3_param_persistence_threshold) stay whole, as the engine keeps them
        idle = [p for p in held if not p.ds_active_sub_modules and p.ds_status.name == "AVAILABLE" and not p.ds_persist]
        if idle:
            idle[0].partition(param_list=idle, has_been_updated=False)


@contextlib.contextmanager
def zero3_per_layer(module: nn.Module, hooks: Iterable[RemovableHandle] = ()) -> Iterator[str]:
    """ZeRO-3 parameters gathered one layer at a time in every forward, one all-gather per layer (see the module
    docstring), with the engine's module hooks detached meanwhile and put back as they were; yields how parameters
    are handled, for the log. Where this cannot apply (no list of layers, a parameter still in flight), the engine's
    hooks gather as they do outside the call."""
    units = _layer_units(module)
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    # Each rank decides alone: every rank has the same modules, and a parameter's status is the same on every rank
    # (the engine gathers and releases in the same order everywhere).
    if not units or any(p.ds_status.name == "INFLIGHT" for p in params):
        yield "the engine's hooks gather each module's parameters"
        return
    gathers: list[_UnitGather] = []
    handles: list[RemovableHandle] = []
    for index, (unit, own) in enumerate(units):
        gather = _UnitGather(own, f"{GENERATION_HOLDER}:{index}")
        gathers.append(gather)
        handles.append(unit.register_forward_pre_hook(gather.gather))
        handles.append(unit.register_forward_hook(gather.release, always_call=True))
    try:
        with hooks_detached(hooks):
            yield f"one all-gather per layer, {len(units)} per forward, the engine's module hooks detached meanwhile"
    finally:
        for handle in handles:
            handle.remove()
        for gather in gathers:  # a forward that failed before its hooks ran leaves nothing else held
            gather.release(module, (), None)
