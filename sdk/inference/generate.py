"""One way to generate under every strategy: shardkit's Llama and Hugging Face models alike.

    model = runner.setup(model)                     # any strategy; no optimizer needed
    out = runner.generate(model, input_ids, max_new_tokens=32, eos_token_id=2)   # on EVERY rank

Every rank calls it, each with its own prompts (any batch size, prompt length, ``max_new_tokens``;
an empty batch is fine). Where a forward is a collective (ZeRO-3, FSDP, tensor parallelism) the ranks
decode in lock step: a rank that is done keeps joining every forward until all are done (Hugging
Face: ``synced_gpus=True``, set here; shardkit's Llama: the same all-reduced flag). Where the strategy's
``generation_context`` holds every parameter whole on every rank for the call (ZeRO-3 and FSDP2 gathered once,
no tensor-parallel split), forwards are local: each rank then decodes on its own, with no per-token
all-reduce and no waiting for the longest rank, and the ranks meet again at their next collective (the
context's release, partitioning the parameters again, is local on every rank). A Hugging Face model decodes with
:func:`shardkit.inference.decode.lean_generate`, whose tokens, forwards and lock step are ``generate``'s, or with
``generate`` for any setting the loop does not reproduce. Ranks of one
tensor-parallel group share every forward, so their prompts are exchanged and each group generates
its members' requests one after the other (identical requests once). A call made on only some ranks
fails within $SHARDKIT_GENERATE_ENTRY_TIMEOUT seconds (60) with :class:`NotCalledOnAllRanksError`.

Where nothing in the call needs another rank (every parameter whole on every rank, a strategy whose
``generation_context`` holds nothing, no tensor-parallel group: DDP, ZeRO-1/2), the call is what it is in one
process: no collective at all, not even the entry check, so a rank neither waits for the others to arrive nor
for their decoding, and a call made on only some ranks is fine.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.inference.decode import lean_generate
from shardkit.inference.sync import any_rank, check_group, distributed, needs_sync, synced_call
from shardkit.utils.operations import move_to_device

__all__ = ["generate", "is_hf_model"]

log = logging.getLogger("shardkit.inference")
_logged: set[str] = set()


def is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face model with ``generate`` (a GenerationMixin), without importing transformers."""
    return any(c.__name__ == "GenerationMixin" for c in type(module).__mro__)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def _device_of(module: nn.Module) -> torch.device:
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        return local.device
    return torch.device("cpu")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _describe_mode(sync: bool, how: str | None) -> str:
    if not sync:
        return "generate: every rank decodes on its own (whole weights on each rank)" + (f"; {how}" if how else "")
    if how is not None:
        return f"generate: ranks decode in lock step; {how}"
    return "generate: ranks decode in lock step (sharded weights: every forward is a collective)"


def _strategy_context(strategy: Any, model: nn.Module, keep_unsharded: bool | None) -> Any:
    if strategy is not None:
        return strategy.generation_context(model, keep_unsharded)
    if keep_unsharded is not None:
        raise ValueError("generate: keep_unsharded is the strategy's to honour; call runner.generate(...) or pass "
                         "strategy=runner.strategy")
    return contextlib.nullcontext(None)


def _still_collective(model: nn.Module, device: torch.device) -> bool:
    """Whether a forward of ``model`` is still a collective inside the strategy's generation context, the same answer
    on every rank (one all-reduce per call).

    A context that holds every parameter whole (a plain tensor: FSDP2 swaps its unsharded parameters in; ZeRO-3's
    gathered ones report so) leaves nothing to gather per forward, so the ranks need not decode in lock step. A
    tensor-parallel split (DTensors still), a parameter gathered per layer, or one a prefetch left in flight keeps
    them in step: the engine's hooks would then gather (or free and gather again) in every forward. One rank with
    such a parameter keeps every rank in step.
    """
    from torch.distributed.tensor import DTensor

    from shardkit.utils.partitioned import handlers

    params = list(model.parameters())
    here = any(isinstance(p, DTensor) for p in params) or any(
        handler.owns(p) and handler.is_partitioned(p) for handler in handlers() for p in params)
    return any_rank(here, device)


def _context_is_local(strategy: Any) -> bool:
    """Whether entering the strategy's generation context talks to no other rank (None: no strategy, no context)."""
    return strategy is None or bool(getattr(strategy, "generation_is_local", False))


def _local_call(model: nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any], strategy: Any,
                keep_unsharded: bool | None) -> Any:
    """A call that needs no other rank (whole parameters everywhere, a context that holds nothing), made as in one
    process: no entry check and no per-token flag, since no forward waits for another rank; the ranks meet again at
    their next collective (a rollout's reward gather)."""
    device = _device_of(model)
    with _strategy_context(strategy, model, keep_unsharded) as how, torch.no_grad():
        _log_once(_describe_mode(False, how))
        return _call(model, move_to_device(input_ids, device), move_to_device(kwargs, device), sync=False)


def _call(module: nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any], sync: bool) -> Any:
    """One generate call on this rank's request (an empty batch joins the others' forwards and returns it)."""
    if is_hf_model(module):
        if sync and kwargs.get("synced_gpus") is False:
            raise ValueError("generate: synced_gpus=False with parameters partitioned across ranks would hang the "
                             "ranks that finish first; leave synced_gpus unset")
        kwargs = {**kwargs, "synced_gpus": sync}
        if input_ids.shape[0] == 0 and not sync:  # nobody waits for this rank's forwards
            return input_ids
        if input_ids.shape[0] == 0:
            keep = {k: v for k, v in kwargs.items() if k in ("synced_gpus", "pad_token_id", "eos_token_id")}
            dummy = torch.zeros((1, 1), dtype=torch.long, device=input_ids.device)
            module.generate(dummy, max_new_tokens=1, do_sample=False, **keep)
            return input_ids
        out = lean_generate(module, input_ids, kwargs)  # token for token generate's, when it reproduces every setting
        return out if out is not None else module.generate(input_ids, **kwargs)
    if "synced" not in inspect.signature(module.generate).parameters:
        raise TypeError(f"generate: {type(module).__name__}.generate has no `synced` argument; shardkit generates "
                        "with shardkit.models.Llama and Hugging Face models (GenerationMixin)")
    return module.generate(input_ids, synced=sync, **kwargs)


def _group_requests(input_ids: torch.Tensor, kwargs: dict, dp_rank: int, group: Any) -> tuple[list, int, int]:
    """Exchange requests with every rank; return this data-parallel group's distinct requests, the index of
    this rank's among them, and the most calls any group needs (so every group runs as many)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    cpu = torch.device("cpu")
    dist.all_gather_object(everyone, (dp_rank, move_to_device(input_ids, cpu), move_to_device(kwargs, cpu)),
                           group=group)
    by_group: dict[int, list[tuple]] = {}
    for r, ids, kw in everyone:
        distinct = by_group.setdefault(r, [])
        if not any(_same(ids, i) and _same(kw, k) for i, k in distinct):
            distinct.append((ids, kw))
    mine = by_group[dp_rank]
    own = (input_ids.cpu(), move_to_device(kwargs, cpu))
    index = next(i for i, (ids, kw) in enumerate(mine) if _same(ids, own[0]) and _same(kw, own[1]))
    return mine, index, max(len(v) for v in by_group.values())


def generate(model: nn.Module, input_ids: torch.Tensor, *, data_parallel_rank: int | None = None,
             data_parallel_size: int | None = None, strategy: Any = None, keep_unsharded: bool | None = None,
             **kwargs: Any) -> Any:
    """Generate on every rank, whatever the strategy (see the module docstring).

    Args:
        model: the user's module (``runner.unwrap_model(model)``): shardkit's Llama or a Hugging Face model.
        input_ids: this rank's prompts, (batch, seq); batch may be 0.
        data_parallel_rank, data_parallel_size: this rank's data-parallel index and the number of them;
            ranks sharing an index (a tensor-parallel group) run each other's requests together. Default:
            every rank is its own.
        strategy: the strategy that set ``model`` up (``runner.strategy``; the Runner passes it): its
            ``generation_context`` holds the parameters for the call (FSDP2, ZeRO-3: gathered once, not per
            token, when memory allows). None: nothing is held (every forward gathers what it needs).
        keep_unsharded: FSDP2 and ZeRO-3: keep parameters gathered across decoding steps (True), gather them in
            every forward (False), or decide from free memory (None). Needs ``strategy``.
        **kwargs: passed to the model's ``generate`` (``max_new_tokens``, ``eos_token_id``, ...).

    Returns:
        What the model's ``generate`` returns for this rank's prompts.

    Raises:
        NotCalledOnAllRanksError: not every rank called it within the entry timeout.
    """
    if not distributed():
        with torch.no_grad():
            return _call(model, input_ids, kwargs, sync=False)
    world = dist.get_world_size()
    grouped = data_parallel_size is not None and data_parallel_size < world
    if not grouped and _context_is_local(strategy) and not needs_sync(model):
        return _local_call(model, input_ids, kwargs, strategy, keep_unsharded)
    sync = needs_sync(model)
    device = _device_of(model)
    with synced_call("runner.generate()"), torch.no_grad():
        requests, index, calls = [(input_ids, kwargs)], 0, 1
        if grouped:
            requests, index, calls = _group_requests(input_ids, kwargs, data_parallel_rank, check_group())
        with _strategy_context(strategy, model, keep_unsharded) as how:
            if sync and how is not None:
                sync = _still_collective(model, device)
            _log_once(_describe_mode(sync, how))
            outputs = [_call(model, move_to_device(ids, device), move_to_device(kw, device), sync)
                       for ids, kw in requests]
            for _ in range(calls - len(requests) if sync else 0):  # another group has more: join its forwards
                _call(model, move_to_device(input_ids[:0], device), move_to_device(kwargs, device), sync)
    return outputs[index]
