"""Activation (gradient) checkpointing: recompute chosen blocks' forward in backward, under every strategy.

    runner = Runner(strategy=ZeRO3(), activation_checkpointing=True)              # the repeated blocks
    runner = Runner(strategy=DDP(), activation_checkpointing=ActivationCheckpointing(LlamaBlock, use_reentrant=True))

One mechanism behind the Runner's switch, ``FSDP(activation_checkpointing=...)``, the Trainer's
``gradient_checkpointing`` for models without their own (shardkit's Llama) and a DeepSpeed config's
``activation_checkpointing`` section: :func:`apply_activation_checkpointing` patches each chosen block's
``forward`` on the instance (not a wrapper module) with a call through ``torch.utils.checkpoint``. Parameter
names, and so checkpoints, stay the same, and the engines' module hooks (FSDP2's unshard, ZeRO-3's gather,
TP's input/output layouts) stay outside the checkpointed function: the recompute in backward runs only the
block's own code, on parameters the engine's backward hooks have already gathered. That is why the patch can
go on before or after ``fully_shard`` / ``deepspeed.initialize`` / ``parallelize_module`` alike; the Runner
applies it in ``setup()`` before the strategy wraps the model, and FSDP before ``fully_shard``.

Hugging Face models that checkpoint themselves (``gradient_checkpointing_enable``) are left to it: a block
whose HF checkpointing is on is not patched a second time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from shardkit.strategies.cp_moe import statistics_layers
from shardkit.utils.operations import json_object
from shardkit.utils.suggest import by_closeness, did_you_mean

__all__ = [
    "ActivationCheckpointing",
    "ActivationCheckpointingError",
    "apply_activation_checkpointing",
    "check_reentrant_supported",
    "checkpointed_modules",
    "enable_gradient_checkpointing",
    "is_module_classes",
    "parse_checkpoint_kwargs",
    "resolve_activation_checkpointing",
    "resolve_module_classes",
]

logger = logging.getLogger("shardkit.strategies.activation_checkpointing")

ModuleClasses = type | str | tuple  # a module class, a class name as configs spell it, or a tuple of them
_MARK = "_shardkit_checkpointing"  # set on each patched block: the settings it was patched with
# torch.utils.checkpoint.checkpoint's keywords a user may pass (HF's gradient_checkpointing_kwargs pass through).
_TORCH_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "context_fn", "early_stop")



class ActivationCheckpointingError(ValueError):
    """Activation checkpointing cannot be applied as asked; the message names the setting and the fix."""


def is_module_classes(value: Any) -> bool:
    """A module class, a class name (as configs spell it, e.g. "LlamaDecoderLayer"), or a non-empty tuple of them."""
    items = value if isinstance(value, tuple) else (value,)
    return bool(items) and all(
        (isinstance(c, type) and issubclass(c, nn.Module)) or (isinstance(c, str) and c) for c in items
    )


_LISTED = 12  # module class names an error lists


def resolve_module_classes(value: Any, module: nn.Module, field_name: str) -> tuple[type, ...]:
    """Turn class names into the classes found in ``module``; a name that matches nothing is an error."""
    items = value if isinstance(value, tuple) else (value,)
    present = {type(m).__name__: type(m) for m in module.modules()}
    classes = []
    for item in items:
        if isinstance(item, type):
            classes.append(item)
        elif item in present:
            classes.append(present[item])
        else:
            shown = by_closeness(str(item), present)
            more = f" and {len(shown) - _LISTED} more" if len(shown) > _LISTED else ""
            raise ValueError(f"{field_name}: no module of class {item!r} in {type(module).__name__}"
                             f"{did_you_mean(str(item), present)}; its module classes, closest first: "
                             f"{', '.join(shown[:_LISTED])}{more}")
    return tuple(classes)


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Which blocks recompute their forward in backward, and how.

    Args:
        blocks: True: the repeated blocks (the classes held in an ``nn.ModuleList``, as FSDP's auto-wrap
            detects them; FSDP uses its auto-wrap classes); a module class, class name, or tuple of them.
        use_reentrant: torch's older autograd-function checkpoint (False, the default, is what torch
            recommends: it supports keyword tensors, inputs without grad and nested backward).
        offload_to_cpu: keep the block inputs saved for the recompute in host memory
            (``torch.autograd.graph.save_on_cpu``; DeepSpeed's ``cpu_checkpointing``).
        synchronize: synchronise the accelerator before and after each block's forward and recompute
            (DeepSpeed's ``synchronize_checkpoint_boundary``; a no-op on a CPU).
        checkpoint_kwargs: further keywords for ``torch.utils.checkpoint.checkpoint``
            (``preserve_rng_state``, ``determinism_check``, ``debug``, ``context_fn``, ``early_stop``).
        deepspeed: the DeepSpeed config's ``activation_checkpointing`` section this came from, if any; the
            strategy also hands it to ``deepspeed.checkpointing`` for models that call it themselves
            (``Strategy.configure_activation_checkpointing``).
    """

    blocks: bool | ModuleClasses = True
    use_reentrant: bool = False
    offload_to_cpu: bool = False
    synchronize: bool = False
    checkpoint_kwargs: Mapping[str, Any] = field(default_factory=dict)
    deepspeed: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.blocks is not False and not isinstance(self.blocks, bool) and not is_module_classes(self.blocks):
            raise ActivationCheckpointingError(f"activation_checkpointing blocks={self.blocks!r} must be True (the "
                                               "repeated blocks), a module class or class name, or a tuple of them")
        for name in ("use_reentrant", "offload_to_cpu", "synchronize"):
            if not isinstance(getattr(self, name), bool):
                raise ActivationCheckpointingError(f"activation_checkpointing {name}={getattr(self, name)!r} must be "
                                                   "True or False")
        object.__setattr__(self, "checkpoint_kwargs", parse_checkpoint_kwargs(self.checkpoint_kwargs))
        if "use_reentrant" in self.checkpoint_kwargs:
            raise ActivationCheckpointingError("activation_checkpointing: give use_reentrant as its own argument, "
                                               "not in checkpoint_kwargs")

    @property
    def enabled(self) -> bool:
        return self.blocks is not False

    def torch_kwargs(self) -> dict[str, Any]:
        """The keywords for ``torch.utils.checkpoint.checkpoint``."""
        return {"use_reentrant": self.use_reentrant, **self.checkpoint_kwargs}

    def options(self) -> tuple:
        """Everything but the block choice: two patches of one block must agree on these."""
        return (self.use_reentrant, self.offload_to_cpu, self.synchronize, tuple(sorted(self.checkpoint_kwargs.items(),
                                                                                       key=lambda kv: kv[0])))


def parse_checkpoint_kwargs(value: Any, where: str = "gradient_checkpointing_kwargs") -> dict[str, Any]:
    """Keywords for ``torch.utils.checkpoint.checkpoint`` from a dict or a JSON object string (as HF takes them)."""
    if value is None:
        return {}
    value = json_object(value, where, "pass a dict (or JSON object) of torch.utils.checkpoint.checkpoint keywords "
                        "such as '{\"use_reentrant\": false}'", error=ActivationCheckpointingError)
    unknown = [k for k in value if k not in _TORCH_KWARGS]
    if unknown:
        raise ActivationCheckpointingError(f"{where}: {unknown[0]!r} is not a torch.utils.checkpoint.checkpoint "
                                           f"keyword{did_you_mean(str(unknown[0]), _TORCH_KWARGS)}; valid: "
                                           f"{list(_TORCH_KWARGS)}")
    if "use_reentrant" in value and not isinstance(value["use_reentrant"], bool):
        raise ActivationCheckpointingError(f"{where}: use_reentrant={value['use_reentrant']!r} must be true or false")
    return dict(value)


def resolve_activation_checkpointing(value: Any) -> ActivationCheckpointing | None:
    """The Runner's ``activation_checkpointing=`` argument as settings: None/False -> None, True/classes ->
    the repeated or named blocks with torch's defaults, a dict -> its fields, settings as they are."""
    if value is None or value is False:
        return None
    if isinstance(value, ActivationCheckpointing):
        return value if value.enabled or value.deepspeed is not None else None
    if isinstance(value, Mapping):
        try:
            return ActivationCheckpointing(**value)
        except TypeError as err:
            raise ActivationCheckpointingError(f"activation_checkpointing={dict(value)!r}: {err}; fields are "
                                               "blocks, use_reentrant, offload_to_cpu, synchronize, "
                                               "checkpoint_kwargs") from None
    return ActivationCheckpointing(blocks=value)


def checkpointed_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` that shardkit's checkpointing patched."""
    return [m for m in module.modules() if _MARK in m.__dict__]


def apply_activation_checkpointing(module: nn.Module, settings: ActivationCheckpointing | None,
                                   default_blocks: tuple[type, ...] | None = None,
                                   owner: str = "activation_checkpointing", strategy: Any = None) -> list[nn.Module]:
    """Patch the chosen blocks of ``module`` to recompute their forward in backward; return the patched blocks.

    Args:
        module: the user's model (not yet wrapped, or wrapped by hooks only).
        settings: what to checkpoint and how; None or disabled: nothing.
        default_blocks: the classes ``blocks=True`` means (FSDP passes its auto-wrap classes); None: the
            repeated blocks.
        owner: how errors name the setting (e.g. "FSDP activation_checkpointing").
        strategy: the strategy that will wrap ``module``, to refuse a combination that cannot work.

    A block already patched with the same options is left as it is (the Runner's switch and FSDP's may both
    name it); with other options it is an error. A Hugging Face layer whose own checkpointing is on is skipped.
    """
    if settings is None or not settings.enabled:
        return []
    if settings.use_reentrant:
        check_reentrant_supported(strategy, owner)
    classes = _block_classes(module, settings.blocks, default_blocks, owner)
    targets = [m for m in module.modules() if m is not module and isinstance(m, classes)]
    inside = {id(c) for t in targets for c in t.modules() if c is not t}
    if settings.use_reentrant:
        _refuse_reentrant_aux_loss(targets, owner)
    patched = []
    for block in targets:
        if id(block) in inside:  # a block inside another checkpointed block is recomputed with it
            continue
        if getattr(block, "gradient_checkpointing", False) is True:
            logger.info("shardkit: %s already checkpoints itself (Hugging Face gradient_checkpointing); left to it",
                        type(block).__name__)
            continue
        previous = block.__dict__.get(_MARK)
        if previous is not None:
            if previous.options() != settings.options():
                raise ActivationCheckpointingError(
                    f"{owner}: {type(block).__name__} is already checkpointed with {previous} and now asked for "
                    f"{settings}; set activation checkpointing in one place (the Runner or the strategy)")
            continue
        _patch_forward(block, settings)
        patched.append(block)
    if patched:
        logger.info("shardkit: %s recomputes %d blocks (%s) in backward: %s", owner, len(patched),
                    ", ".join(sorted({type(b).__name__ for b in patched})), settings)
    return patched


def check_reentrant_supported(strategy: Any, owner: str = "activation_checkpointing") -> None:
    """Refuse use_reentrant=True where it cannot work: under DDP(find_unused_parameters=True) (without
    static_graph) the backward fails with "Expected to mark a variable ready only once" (measured on 2 ranks):
    DDP walks the graph after forward, finds no checkpointed block's parameter in it (the reentrant forward runs
    without grad), marks them ready as unused, and then their gradients arrive from the recompute."""
    settings = getattr(strategy, "settings", None)
    if getattr(settings, "find_unused_parameters", False) and not getattr(settings, "static_graph", False):
        raise ActivationCheckpointingError(
            f"{owner}: use_reentrant=True cannot run under DDP(find_unused_parameters=True): DDP marks the "
            "checkpointed blocks' parameters unused after the forward, then their gradients arrive in backward. Use "
            "use_reentrant=False (the default), or DDP(static_graph=True) instead of find_unused_parameters")


def _refuse_reentrant_aux_loss(blocks: list[nn.Module], owner: str) -> None:
    """An MoE layer hands its auxiliary loss to the model's loss through an attribute, not through the block's
    output; reentrant checkpointing runs the block's forward without grad, so that loss would add its value but none
    of its gradient (the routers and everything before them would get wrong gradients, unsaid)."""
    for block in blocks:
        for layer in statistics_layers(block):
            coef = getattr(getattr(layer, "config", None), "aux_loss_coef", None)
            if coef != 0:
                raise ActivationCheckpointingError(
                    f"{owner}: use_reentrant=True cannot checkpoint {type(block).__name__}: its MoE layer "
                    f"{type(layer).__name__} adds an auxiliary loss (aux_loss_coef={coef}) that reentrant "
                    "checkpointing computes without grad, so its gradient would be lost; use use_reentrant=False "
                    "(the default), or aux_loss_coef=0")


def _block_classes(module: nn.Module, blocks: Any, default_blocks: tuple[type, ...] | None,
                   owner: str) -> tuple[type, ...]:
    if blocks is True:
        if default_blocks is None:
            from shardkit.strategies._dtensor import repeated_blocks

            default_blocks = repeated_blocks(module)
        if not default_blocks:
            raise ActivationCheckpointingError(
                f"{owner}=True found no repeated block (no nn.ModuleList) in {type(module).__name__}; name the block "
                "class, e.g. activation_checkpointing=LlamaBlock")
        return tuple(default_blocks)
    return resolve_module_classes(blocks, module, owner)


def _patch_forward(block: nn.Module, settings: ActivationCheckpointing) -> None:
    """Instance-level forward through torch.utils.checkpoint; the module's hooks stay outside it."""
    forward = block.forward
    kwargs = settings.torch_kwargs()

    def run(*args: Any, **kw: Any) -> Any:
        _synchronize(settings.synchronize)
        out = forward(*args, **kw)
        _synchronize(settings.synchronize)
        return out

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kw: Any) -> Any:
        if not torch.is_grad_enabled():  # eval and generation: nothing is saved, nothing to recompute
            return forward(*args, **kw)
        offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) \
            if settings.offload_to_cpu else _NULL
        with offload:
            if settings.use_reentrant:
                _check_reentrant_inputs(block, args, kw)
                return torch.utils.checkpoint.checkpoint(functools.partial(run, **kw), *args, **kwargs)
            return torch.utils.checkpoint.checkpoint(run, *args, **kwargs, **kw)

    block.forward = checkpointed
    block.__dict__[_MARK] = settings


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


def _synchronize(enabled: bool) -> None:
    if enabled and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _check_reentrant_inputs(block: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Reentrant checkpointing gives gradients only through positional tensors that require grad: refuse
    what would silently lose gradients."""
    name = type(block).__name__
    grad_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if grad_kwargs:
        raise ActivationCheckpointingError(
            f"use_reentrant=True: {name} gets {grad_kwargs} by keyword with requires_grad, and reentrant "
            "checkpointing passes no gradient to keyword tensors; use use_reentrant=False")
    needs = any(p.requires_grad for p in block.parameters())
    if needs and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise ActivationCheckpointingError(
            f"use_reentrant=True: no positional input of {name} requires grad, so reentrant checkpointing would "
            "give its parameters no gradient (frozen embeddings, e.g. under LoRA); use use_reentrant=False, or "
            "make the inputs require grad (Hugging Face: model.enable_input_require_grads())")


def with_options(settings: ActivationCheckpointing | None, **changes: Any) -> ActivationCheckpointing:
    """``settings`` (or the repeated-block default) with ``changes``; keeps a DeepSpeed section's options."""
    return replace(settings if settings is not None else ActivationCheckpointing(), **changes)


def enable_gradient_checkpointing(model: nn.Module, args: Any, runner: Any) -> str | None:
    """The Trainer's ``gradient_checkpointing`` (+ ``gradient_checkpointing_kwargs``) on ``model``.

    A Hugging Face model checkpoints itself (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` on older transformers) with the kwargs, ``use_reentrant`` False unless
    given; any other model (shardkit's Llama) gets the Runner's switch on its repeated blocks. Returns "model",
    "runner", or None when off.
    """
    if not getattr(args, "gradient_checkpointing", False):
        return None
    kwargs = {"use_reentrant": False, **parse_checkpoint_kwargs(getattr(args, "gradient_checkpointing_kwargs", None))}
    if kwargs["use_reentrant"]:
        check_reentrant_supported(runner.strategy, "gradient_checkpointing_kwargs")
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return "model"
    current = runner.activation_checkpointing  # a DeepSpeed section's offload/sync options are kept
    blocks = current.blocks if current is not None and current.enabled else True
    runner.activation_checkpointing = with_options(current, blocks=blocks, use_reentrant=kwargs.pop("use_reentrant"),
                                                   checkpoint_kwargs=kwargs)
    return "runner"
