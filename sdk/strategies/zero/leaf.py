"""Which modules ZeRO-3 fetches as one unit: mixture-of-experts blocks.

ZeRO-3 gathers a module's partitions in a pre-forward hook and prefetches the next ones from the order recorded in
the first step; every gather is a collective, so every rank must enter the same modules in the same order. An MoE
block runs only the experts its tokens were routed to, which differs between ranks: when its experts are separate
modules (a ``ModuleList``, as older transformers and remote-code models keep them), a rank whose batch skips an
expert gathers another module's parameters while its peers gather that expert's, and the job hangs or mixes up
buffers. transformers 5 stacks the experts in one module, but its eager loop still calls the ``act_fn`` submodule once
per expert hit, so the ranks' module traces differ and DeepSpeed stops ("disagreement on list length"). DeepSpeed's
remedy is to flag the whole block a *leaf*: its parameters are gathered together when the block starts, and nothing
inside it is hooked. (DeepSpeed 0.18+ flags three transformers classes by default, unless its ``leaf_module`` config
replaces the list; the structural search here covers the rest and does not depend on that default.)

A block is recognised by its structure, not its class name, so shardkit's own ``MoE``, transformers 5's
Qwen2-MoE / Qwen3-MoE / Mixtral sparse blocks and remote-code models' blocks are all found: a module with a router
child (``gate`` or ``router``) and an ``experts`` child that holds either stacked 3-D ``gate_up_proj`` and
``down_proj`` parameters or a ``ModuleList`` of expert modules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

__all__ = ["find_moe_blocks", "mark_leaf_modules"]

log = logging.getLogger(__name__)

_ROUTER_NAMES = ("gate", "router")


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module) or not any(isinstance(getattr(module, n, None), nn.Module)
                                                     for n in _ROUTER_NAMES):
        return False
    if isinstance(experts, nn.ModuleList):
        return len(experts) > 1
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3 \
        and down.dim() == 3


def find_moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts blocks of ``model`` (outermost only: a block inside a found block is part of it)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents come before their children
        if id(module) in inside:
            continue
        if _is_moe_block(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _matches(module: nn.Module, wanted: Sequence[type | str]) -> bool:
    cls = type(module)
    for w in wanted:
        if isinstance(w, type) and isinstance(module, w):
            return True
        if isinstance(w, str) and w in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def mark_leaf_modules(model: nn.Module, extra: Sequence[type | str] = (), announce: bool = True) -> list[nn.Module]:
    """Flag every MoE block of ``model`` and every module matching ``extra`` (classes, or class names plain or
    qualified) as a ZeRO-3 leaf module; returns the flagged modules. Must run before the engine is built (its hooks
    read the flag when they are registered).

    Raises:
        ValueError: an entry of ``extra`` that matches no module of ``model`` (a misspelt name would otherwise leave
            the block hooked per expert, and the hang this prevents, without a word).
    """
    from deepspeed.utils import set_z3_leaf_module

    wanted = list(extra)
    for w in wanted:
        if not isinstance(w, (type, str)):
            raise ValueError(f"ZeRO3 leaf_modules entries are classes or class names, not {w!r}")
    unmatched = [w for w in wanted if not any(_matches(m, [w]) for m in model.modules())]
    if unmatched:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"ZeRO3 leaf_modules: {unmatched} match no module of {type(model).__name__}; its module "
                         f"classes are {names}")
    leaves = find_moe_blocks(model)
    seen = {id(m) for m in leaves}
    for m in model.modules():
        if wanted and id(m) not in seen and _matches(m, wanted):
            leaves.append(m)
            seen.add(id(m))
    for m in leaves:
        set_z3_leaf_module(m, True)
    if leaves and announce:
        classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in leaves})
        log.info("shardkit: ZeRO-3 fetches %d module(s) whole, as DeepSpeed leaf modules (mixture-of-experts "
                 "blocks%s): %s", len(leaves), " and leaf_modules" if wanted else "", ", ".join(classes))
    return leaves
