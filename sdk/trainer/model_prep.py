"""What the Trainer does to the model before the strategy sets it up: fused kernels and torch.compile.

- ``use_fused_kernels=True`` (or Hugging Face's name, ``use_liger_kernel=True``) patches a transformers
  Llama/Mistral/Qwen2/Gemma model in place with :func:`shardkit.nn.apply_fused_kernels`, before setup, so every
  strategy wraps the patched modules (FSDP shards them, ZeRO-3 partitions their parameters; the patches are
  instance attributes on the very modules the engines keep). ``liger_kernel_config`` takes Liger's switches
  (``rope``, ``swiglu``, ``rms_norm``, ``fused_linear_cross_entropy``); the ones shardkit has no kernel for are
  refused by name rather than ignored. shardkit's own Llama picks its kernels when built (``LlamaConfig.fused``).
- ``torch_compile=True`` (implied by ``torch_compile_backend`` or ``torch_compile_mode``, as in Hugging Face)
  compiles the model in place with ``nn.Module.compile``, as the last change before setup. In place, not
  ``torch.compile(model)``: the module keeps its class, its parameter names and its state-dict keys, so every
  strategy wraps it as usual and checkpoints load into an uncompiled model.

  Checked on 2 CPU ranks (gloo) with the "eager" backend, a tiny HF Llama trained 3 steps: DDP, FSDP, ZeRO-2 and
  ZeRO-3 give the uncompiled run's losses, as does TensorParallel with shardkit's Llama; tests keep one
  single-process check (tracing costs ~10 s per strategy on CPU). "inductor" is checked on one process only
  (its first CPU compile of even a 2-layer model takes about a minute): under the engines it is untested here.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch import nn

from shardkit.utils.suggest import did_you_mean

__all__ = ["LIGER_KEYS", "NonFiniteOutputError", "apply_fused_kernels_for", "apply_model_prep", "check_model_prep_args",
           "compile_model", "fused_kernel_options", "install_overflow_check", "is_compiled", "maybe_compile"]

logger = logging.getLogger("shardkit.trainer")

# Liger's switch -> apply_fused_kernels's keyword (None: shardkit has no such kernel, so True is refused).
LIGER_KEYS: dict[str, str | None] = {"rope": "rope", "swiglu": "swiglu", "rms_norm": "rms_norm",
                                     "fused_linear_cross_entropy": "cross_entropy", "cross_entropy": None,
                                     "geglu": "geglu", "layer_norm": None}
_NO_KERNEL = {"cross_entropy": "the fused linear cross-entropy replaces it (fused_linear_cross_entropy=True)",
              "layer_norm": "only RMSNorm is fused"}


def check_model_prep_args(args: Any) -> None:
    """Check and normalise the fields this module reads (called by ``TrainingArguments.__post_init__``)."""
    alpha = args.neftune_noise_alpha
    number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
    if alpha is not None and (not number or not 0 < alpha < math.inf):
        raise ValueError(f"TrainingArguments.neftune_noise_alpha={alpha!r} must be a positive finite number (the "
                         "NEFTune paper uses 5 to 15) or None to turn it off")
    for name in ("use_liger_kernel", "use_fused_kernels", "torch_compile"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"TrainingArguments.{name}={getattr(args, name)!r} must be True or False")
    if isinstance(args.liger_kernel_config, str):
        import json

        try:
            args.liger_kernel_config = json.loads(args.liger_kernel_config)
        except ValueError as err:
            raise ValueError(f"TrainingArguments.liger_kernel_config is not valid JSON ({err}): pass a dict such "
                             'as {"rope": true, "swiglu": false}') from err
    if args.liger_kernel_config is not None:
        if not (args.use_liger_kernel or args.use_fused_kernels):
            raise ValueError("TrainingArguments.liger_kernel_config is set but the kernels are off: set "
                             "use_fused_kernels=True (or use_liger_kernel=True), or drop liger_kernel_config")
        fused_kernel_options(args.liger_kernel_config)
    if args.torch_compile_backend is not None or args.torch_compile_mode is not None:
        args.torch_compile = True
    if args.torch_compile:
        args.torch_compile_backend = _check_backend(args.torch_compile_backend or "inductor")
        _check_mode(args.torch_compile_mode, args.torch_compile_backend)


def fused_kernel_options(config: dict[str, Any] | None) -> dict[str, bool]:
    """``apply_fused_kernels`` keywords from a ``liger_kernel_config`` dict (None: every kernel on).

    Raises:
        ValueError: an unknown key, a non-bool value, or True for a kernel shardkit does not have.
    """
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"TrainingArguments.liger_kernel_config must be a dict of switches, got "
                         f"{type(config).__name__}")
    options: dict[str, bool] = {}
    for key, value in config.items():
        if key not in LIGER_KEYS:
            raise ValueError(f"TrainingArguments.liger_kernel_config: unknown key {key!r}"
                             f"{did_you_mean(str(key), tuple(LIGER_KEYS))} Known: {sorted(LIGER_KEYS)}")
        if not isinstance(value, bool):
            raise ValueError(f"TrainingArguments.liger_kernel_config[{key!r}]={value!r} must be true or false")
        target = LIGER_KEYS[key]
        if target is None:
            if value:
                raise ValueError(f"TrainingArguments.liger_kernel_config[{key!r}]=True: shardkit has no {key} "
                                 f"kernel ({_NO_KERNEL[key]}); set it to false or leave it out")
            continue
        options[target] = value
    return options


def _check_backend(backend: Any) -> Any:
    if callable(backend):
        return backend
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"TrainingArguments.torch_compile_backend={backend!r} is not a torch.compile backend"
                         f"{did_you_mean(str(backend), tuple(known))} Use one of {known} (default 'inductor')")
    return backend


def _check_mode(mode: str | None, backend: Any) -> None:
    if mode is None:
        return
    import torch._inductor

    modes = tuple(torch._inductor.list_mode_options())
    if mode not in modes:
        raise ValueError(f"TrainingArguments.torch_compile_mode={mode!r} is not valid{did_you_mean(mode, modes)} "
                         f"Use one of {list(modes)}")
    if backend != "inductor":
        raise ValueError(f"TrainingArguments.torch_compile_mode={mode!r} is an inductor setting but "
                         f"torch_compile_backend={backend!r}: drop torch_compile_mode or use the 'inductor' backend")


def _patch_target(model: nn.Module) -> nn.Module:
    # A peft PeftModel wraps the transformers model: the kernels go on the model it wraps.
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def apply_fused_kernels_for(model: nn.Module, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Patch ``model`` in place for ``use_fused_kernels``; returns what was patched (``fused_kernels_report``).

    Raises:
        ValueError: a model neither transformers' supported families nor a shardkit Llama built fused.
    """
    from shardkit.models import Llama
    from shardkit.nn import apply_fused_kernels

    options = fused_kernel_options(config)
    if isinstance(model, Llama):
        if not model.config.fused:
            raise ValueError("use_fused_kernels=True: this shardkit Llama was built with LlamaConfig(fused=False); "
                             "its kernels are chosen when it is built: build it with LlamaConfig(fused=True)")
        return {"model_type": "shardkit-llama", "built_fused": True}
    target = _patch_target(model)
    try:
        apply_fused_kernels(target, **options)
    except ValueError as err:
        raise ValueError(f"use_fused_kernels=True (use_liger_kernel): {err} Or set use_fused_kernels=False") from err
    return target.fused_kernels_report


def compile_model(model: nn.Module, backend: Any = "inductor", mode: str | None = None) -> nn.Module:
    """Compile ``model`` in place (``nn.Module.compile``): same object, class and state-dict keys."""
    model.compile(backend=backend, mode=mode)
    logger.info("torch_compile: %s compiled in place (backend=%s, mode=%s)", type(model).__name__, backend, mode)
    return model


def maybe_compile(model: nn.Module, args: Any) -> nn.Module:
    """``compile_model`` when ``args.torch_compile`` (called by the Trainer right before ``runner.setup``)."""
    if args.torch_compile:
        compile_model(model, args.torch_compile_backend, args.torch_compile_mode)
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules was compiled in place."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


class NonFiniteOutputError(FloatingPointError):
    """``debug="underflow_overflow"``: a module's output held inf or NaN; the message names the module."""


def install_overflow_check(model: nn.Module) -> list[Any]:
    """``debug="underflow_overflow"``: a forward hook on every module raises at the first output holding inf or
    NaN, naming the module (the first place it appears, not where the loss shows it steps later). Returns the
    hook handles."""
    import torch

    def check(name: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            tensors = output if isinstance(output, (tuple, list)) else [output]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    raise NonFiniteOutputError(f"debug='underflow_overflow': the output of {name or 'the model'} "
                                         f"({type(module).__name__}) holds inf or NaN")
        return hook

    return [m.register_forward_hook(check(n)) for n, m in model.named_modules()]


def apply_model_prep(model: nn.Module, args: Any) -> nn.Module:
    """The fused-kernel patch (when asked for): called by the Trainer on the user's model before anything
    reads its forward (the patched causal-LM forward is what the loss bookkeeping must see)."""
    if args.use_fused_kernels or args.use_liger_kernel:
        report = apply_fused_kernels_for(model, args.liger_kernel_config)
        logger.info("use_fused_kernels: %s", report)
    return model
