"""Sharded model construction that gives, bitwise, the weights an unsharded build gives.

A model's own init often runs after its submodules are built: ``Llama.reset_parameters`` at the end
of ``Llama.__init__``, Hugging Face's ``post_init``. Under ZeRO-3's ``zero.Init`` the submodules'
parameters are partitioned by then (their ``data`` is an empty tensor), and on the meta device they
hold no data at all: the init writes nowhere and, worse, draws no random numbers, so every later
init draws from another point of the RNG stream. Two tools here keep the stream and the weights:

* ``ZeroInitInterceptor`` (ZeRO-3, in ``zero/init.py``, on the :class:`TrackingMode` defined here): a
  write to a partitioned parameter (an ``nn.init`` function, an in-place method, through ``.data`` or a
  view) runs on the whole parameter inside ``GatheredParameters(modifier_rank=0)``, one parameter at a
  time, on every rank.
* :class:`MetaInitRecorder` (FSDP): parameters are built on the meta device; each write is recorded
  with the RNG state it started from and run once on a scratch tensor of the parameter's size (so
  the stream advances exactly as in an unsharded build, then the scratch is freed). After sharding,
  :func:`replay_into` rebuilds each parameter on its own from its record and keeps the local shard.

Either way no rank holds more than one whole parameter (plus its shards) at a time. A write that
cannot be honoured (it reads a partitioned or meta tensor as a source, or writes through a view that
a partition cannot take) raises an error that names the module's parameter and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["MetaInitRecorder", "ShardedInitError", "TrackingMode", "apply_chain", "rank0_rng", "replay_into"]

log = logging.getLogger("shardkit.strategies")

_INIT_FUNCTIONS = {getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")}
# In-place methods whose name ends in "_" but that write no values.
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad", "record_stream", "pin_memory_", "resize_",
               "set_", "detach_", "rename_", "refine_names_", "align_to_"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
# Writes that replace every element (the record of earlier writes can be dropped).
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
               "geometric_", "cauchy_", "log_normal_"}


class ShardedInitError(RuntimeError):
    """Init code wrote to a sharded parameter in a way that cannot give the unsharded weights."""


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "")


def _is_data_getter(func: Callable) -> bool:
    return _name(func) == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data


def _is_write(func: Callable) -> bool:
    if func in _INIT_FUNCTIONS:
        return True
    name = _name(func)
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def _overwrites(func: Callable, chain: list) -> bool:
    return not chain and (func in _INIT_FUNCTIONS or _name(func) in _OVERWRITES)


def _target(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))


def _tensors_in(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors_in(v)


# ---- RNG -----------------------------------------------------------------------------------------------


def _capture_rng(device: torch.device, kwargs: dict) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    gen = kwargs.get("generator")
    if isinstance(gen, torch.Generator):
        state["generator"] = gen.get_state()
    return state


def _restore_rng(state: dict[str, Any], device: torch.device, kwargs: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if "generator" in state:
        kwargs["generator"].set_state(state["generator"])


@contextlib.contextmanager
def rank0_rng(device: torch.device) -> Iterator[None]:
    """Every rank draws from rank 0's RNG stream inside the block, as one unsharded build would.

    Where the ranks' streams already agree (the Runner seeded them alike) they simply go on from
    there; where they differed, each rank gets its own stream back on exit.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    own = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        own["cuda"] = torch.cuda.get_rng_state(device)
    shared = {}
    for key, value in own.items():
        # NOTE: gloo and NCCL both move uint8; NCCL needs the tensor on the device.
        buf = value.clone().to(device if device.type == "cuda" else "cpu")
        dist.broadcast(buf, src=0)
        shared[key] = buf.cpu()
    same = all(torch.equal(own[k], shared[k]) for k in own)
    torch.set_rng_state(shared["cpu"])
    if "cuda" in shared:
        torch.cuda.set_rng_state(shared["cuda"], device)
    try:
        yield
    finally:
        if not same:
            torch.set_rng_state(own["cpu"])
            if "cuda" in own:
                torch.cuda.set_rng_state(own["cuda"], device)


# ---- the common mode -----------------------------------------------------------------------------------


class TrackingMode(TorchFunctionMode):
    """Follows writes to tracked parameters, through ``.data`` and views, and hands each to ``_write``.

    A subclass says which tensors it tracks (``is_tracked``) and what a write to one does (``_write``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.owners = WeakIdKeyDictionary()  # parameter -> "Class.attr" for messages
        self._aliases = WeakIdKeyDictionary()  # alias tensor -> (parameter, chain of view calls)
        self._original_register: Callable | None = None
        self.holders: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules that registered tracked params

    def __enter__(self):
        self._original_register = original = nn.Module.register_parameter
        mode = self

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            param = mode._on_register(param)
            if param is not None and param not in mode.owners:
                mode.owners[param] = f"{type(module).__name__}.{name}"
            if param is not None and mode.is_tracked(param):
                mode.holders.add(module)
            original(module, name, param)

        nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            return super().__enter__()
        except BaseException:
            nn.Module.register_parameter = original  # type: ignore[method-assign]
            raise

    def __exit__(self, *exc):
        nn.Module.register_parameter = self._original_register  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def _on_register(self, param: nn.Parameter | None) -> nn.Parameter | None:
        """The parameter to register in place of ``param`` (the recorder puts it on the meta device)."""
        return param

    def describe(self, param: torch.Tensor) -> str:
        owner = self.owners.get(param, "a parameter")
        return f"{owner} (shape {list(self.full_shape(param))})"

    def _resolve(self, t: Any) -> tuple[torch.Tensor, list] | None:
        if not isinstance(t, torch.Tensor):
            return None
        if t in self._aliases:
            return self._aliases[t]
        return (t, []) if self.is_tracked(t) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        resolved = self._resolve(_target(args, kwargs))
        if resolved is None:
            self._check_untracked(func, args, kwargs)
            return func(*args, **kwargs)
        param, chain = resolved
        if _is_write(func):
            rest = args[1:] if args else ()
            out_kwargs = {k: v for k, v in kwargs.items() if k not in ("tensor", "input", "self")}
            if any(self._resolve(t) is not None for t in _tensors_in([*rest, *out_kwargs.values()])):
                raise ShardedInitError(f"init code copies one sharded parameter into another ({_name(func)} into "
                                       f"{self.describe(param)}); do it after runner.setup() inside "
                                       "runner.gathered_parameters(...)")
            self._write(param, chain, func, rest, out_kwargs)
            return _target(args, kwargs)
        if "out" in kwargs and self._resolve(kwargs["out"]) is not None:
            raise ShardedInitError(f"init code writes {_name(func)}(out=...) into {self.describe(param)}; write the "
                                   "parameter in place (e.g. p.copy_(...)) instead")
        out = self._view(param, chain, func, args, kwargs)
        return out

    def _view(self, param, chain, func, args, kwargs):
        try:
            out = func(*args, **kwargs)
        except (IndexError, RuntimeError) as err:
            out = self._stand_in_view(param, chain, func, args, kwargs)
            if out is not None:
                self._aliases[out] = (param, [*chain, (func, tuple(args[1:]), dict(kwargs))])
                return out
            raise ShardedInitError(f"init code takes {_name(func)} of {self.describe(param)}, which is sharded while "
                                   f"the model is built ({err}); write the whole parameter (nn.init.*, p.copy_) or "
                                   "do it after runner.setup() inside runner.gathered_parameters(...)") from None
        if isinstance(out, torch.Tensor) and (_is_data_getter(func) or out._is_view()):
            step = (func, tuple(args[1:]), dict(kwargs))
            self._aliases[out] = (param, [*chain, step])
        return out

    def _stand_in_view(self, param, chain, func, args, kwargs) -> torch.Tensor | None:
        """A view that the sharded tensor cannot take (``p.data[0]`` of an empty partition), taken of a
        meta tensor of the whole shape instead, so that a write through it can be replayed; None: refuse."""
        return None

    def _check_untracked(self, func, args, kwargs) -> None:
        """Hook for writes to tensors that are not tracked (the recorder refuses RNG draws into meta tensors)."""

    def is_tracked(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def full_shape(self, param: torch.Tensor) -> torch.Size:
        return param.shape

    def _write(self, param, chain, func, rest, kwargs) -> None:
        raise NotImplementedError


def apply_chain(t: torch.Tensor, chain: list) -> torch.Tensor:
    """Replay the view calls recorded for an alias (``p.data[0]``) on ``t``."""
    for func, rest, kwargs in chain:
        t = func(t, *rest, **kwargs)
    return t


# ---- meta device (FSDP) --------------------------------------------------------------------------------


@dataclass
class _Entry:
    func: Callable
    chain: list
    rest: tuple
    kwargs: dict
    rng: dict[str, Any]


@dataclass
class ParamRecord:
    """How to rebuild one parameter: its first value (until overwritten) and the writes that followed."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    initial: torch.Tensor | None = None
    entries: list[_Entry] = field(default_factory=list)

    def build(self, device: torch.device | None = None) -> torch.Tensor:
        """The parameter's whole value, as the unsharded build left it (the RNG is restored by the caller)."""
        device = device or self.device
        full = self.initial.to(device, copy=True) if self.initial is not None else \
            torch.empty(self.shape, dtype=self.dtype, device=device)
        for e in self.entries:
            _restore_rng(e.rng, device, e.kwargs)
            with torch.no_grad():
                e.func(apply_chain(full, e.chain), *e.rest, **e.kwargs)
        return full


class MetaInitRecorder(TrackingMode):
    """Builds parameters on the meta device and records, per parameter, how to rebuild it.

    Use as a context manager around the model's construction; ``records`` maps each meta parameter
    to its :class:`ParamRecord`. Buffers stay real (models compute them in ``__init__``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.records = WeakIdKeyDictionary()
        self.peak_scratch_bytes = 0

    def _on_register(self, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return param  # a tied parameter registered again stays the same object
        real = param.detach()
        meta = type(param)(real.to("meta"), requires_grad=param.requires_grad)
        self.records[meta] = ParamRecord(real.shape, real.dtype, real.device, param.requires_grad, initial=real)
        return meta

    def __exit__(self, *exc):
        # Weights loaded between init_module() and setup() (``model.load_state_dict(...)``) would land on
        # the meta device and be lost; each module holding recorded parameters takes them into the record.
        hook = functools.partial(_load_into_records, self.records)
        for module in list(self.holders):
            module.register_load_state_dict_pre_hook(hook)
        return super().__exit__(*exc)

    def is_tracked(self, t: torch.Tensor) -> bool:
        return t in self.records

    def _check_untracked(self, func, args, kwargs) -> None:
        target = _target(args, kwargs)
        if isinstance(target, torch.Tensor) and target.is_meta and _is_write(func) and \
                (func in _INIT_FUNCTIONS or _name(func) in _OVERWRITES - {"fill_", "zero_", "copy_"}):
            raise ShardedInitError(f"init code draws random numbers ({_name(func)}) into a tensor on the meta device "
                                   "that is not a parameter, so the draw cannot be replayed; build that tensor with "
                                   "a real device (e.g. torch.empty(..., device='cpu')) or use init_module(empty_init="
                                   "False)")

    def _write(self, param, chain, func, rest, kwargs) -> None:
        record: ParamRecord = self.records[param]
        if any(t.is_meta for t in _tensors_in([*rest, *kwargs.values()])):
            raise ShardedInitError(f"init code writes {_name(func)} into {self.describe(param)} from a tensor on the "
                                   "meta device, which has no values; use init_module(empty_init=False) for this model")
        rest = tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in rest)
        entry = _Entry(func, list(chain), rest, dict(kwargs), _capture_rng(record.device, kwargs))
        # Run it once for real on a scratch tensor so the RNG advances exactly as in an unsharded build.
        scratch = record.initial.clone() if record.initial is not None else \
            torch.empty(record.shape, dtype=record.dtype, device=record.device)
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, scratch.numel() * scratch.element_size())
        with torch.no_grad():
            func(apply_chain(scratch, chain), *rest, **kwargs)
        del scratch
        if _overwrites(func, chain):
            record.initial, record.entries = None, [entry]
        else:
            record.entries.append(entry)


def _load_into_records(records, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook on a module built by :class:`MetaInitRecorder`: a loaded value replaces
    the parameter's record (the meta parameter itself cannot take it), so ``setup`` shards the loaded weights."""
    for name, param in module._parameters.items():
        key = prefix + name
        if param is not None and param in records and key in state_dict:
            value = state_dict[key]
            record: ParamRecord = records[param]
            if tuple(value.shape) != tuple(record.shape):
                continue  # load_state_dict reports the size mismatch itself
            record.initial, record.entries = value.detach().to(record.device, record.dtype, copy=True), []


@torch.no_grad()
def replay_into(module: nn.Module, records: dict[str, ParamRecord], device: torch.device) -> None:
    """Fill every (sharded, materialised) parameter of ``module`` named in ``records`` from its record.

    Each parameter is rebuilt whole on ``device``, its local shard copied in, and the whole freed
    before the next; the RNG state is left as it was.
    """
    from shardkit.strategies._dtensor import local_part, local_tensor

    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        for name, p in module.named_parameters():
            record = records.get(name)
            if record is None:
                continue
            full = record.build(device).to(p.dtype)
            local_tensor(p).copy_(local_part(full, p))
            del full
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
