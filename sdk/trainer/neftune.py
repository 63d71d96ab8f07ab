"""NEFTune: uniform noise on the input embeddings while training (Jain et al., 2023, "NEFTune: Noisy Embeddings
Improve Instruction Finetuning"), as ``TrainingArguments(neftune_noise_alpha=5.0)`` turns it on.

    with neftune(model, alpha=5.0):      # model: the user's module (the strategy's wrapper is looked through)
        train()

The noise is ``U(-1, 1) * alpha / sqrt(L * d)`` added to the embedding module's output, where L is the
sequence length (dim 1 of the output, padding included, as Hugging Face does) and d the embedding width.
It is added only while the embedding module is in training mode, so evaluation and generation
(``model.eval()``) see the plain embeddings, and the hook is removed when the block exits, exception or not.

The hook goes on the embedding module itself, which every strategy keeps as the same object: DDP and
DeepSpeed wrap the root only, FSDP2's ``fully_shard`` changes the class of the modules it shards in place and
ZeRO-3 adds its own hooks to them; a forward hook registered on the module runs after theirs, on the output.
A compiled model (``torch_compile``) recompiles once when the hook comes and once when it goes.
The noise comes from torch's global RNG, so activation checkpointing (which saves and restores that RNG
around a recomputation) recomputes the same noise, and ranks seeded alike draw alike (tensor parallelism needs
the same noise on every rank of a replicated activation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardkit.trainer.model_prep import is_compiled

__all__ = ["NEFTuneHook", "find_input_embeddings", "neftune", "neftune_noise"]


def find_input_embeddings(model: nn.Module) -> nn.Module:
    """The module whose output is the input embeddings: ``get_input_embeddings()`` (Hugging Face models),
    else an ``embed_tokens`` attribute (shardkit's Llama), else the model's only ``nn.Embedding``.

    Raises:
        ValueError: none of those finds exactly one module.
    """
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            found = getter()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, nn.Module):
            return found
    found = getattr(model, "embed_tokens", None)
    if isinstance(found, nn.Module):
        return found
    embeddings = [name for name, module in model.named_modules() if isinstance(module, nn.Embedding)]
    if len(embeddings) == 1:
        return model.get_submodule(embeddings[0])
    raise ValueError(f"neftune_noise_alpha: cannot tell which module of {type(model).__name__} makes the input "
                     f"embeddings (no get_input_embeddings(), no embed_tokens, {len(embeddings)} nn.Embedding "
                     f"modules{': ' + ', '.join(embeddings) if embeddings else ''}). Give the model a "
                     "get_input_embeddings() method that returns it, or set neftune_noise_alpha=None")


def neftune_noise(embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """Noise for ``embeddings`` (batch, L, d): uniform in ``[-alpha / sqrt(L d), alpha / sqrt(L d)]``.

    A DTensor (tensor parallelism's sequence-sharded embeddings) gets noise of its global shape's scale.
    """
    if embeddings.dim() < 3:
        raise ValueError(f"neftune_noise_alpha: the input embeddings have shape {tuple(embeddings.shape)}; NEFTune "
                         "needs (batch, sequence, dim). Set neftune_noise_alpha=None for this model")
    bound = alpha / math.sqrt(embeddings.shape[1] * embeddings.shape[2])
    return torch.empty_like(embeddings).uniform_(-bound, bound)


class NEFTuneHook:
    """A forward hook adding NEFTune noise to a module's output in training mode (see the module docstring)."""

    def __init__(self, alpha: float):
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0 or math.isinf(alpha):
            raise ValueError(f"neftune_noise_alpha={alpha!r} must be a positive finite number (the paper uses 5 to "
                             "15), or None to turn NEFTune off")
        self.alpha = float(alpha)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not module.training or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return output
        return output + neftune_noise(output, self.alpha)


@contextlib.contextmanager
def neftune(model: nn.Module, alpha: float | None, unwrap: Any = None) -> Iterator[nn.Module | None]:
    """Install NEFTune on ``model``'s input embeddings for the block; yields the embedding module (None when
    ``alpha`` is None, which does nothing).

    Args:
        model: the user's model, or a strategy's wrapper of it when ``unwrap`` is given.
        alpha: ``neftune_noise_alpha``.
        unwrap: the Runner's ``unwrap_model`` (looks through DDP / DeepSpeed wrappers).
    """
    if alpha is None:
        yield None
        return
    hook = NEFTuneHook(alpha)
    inner = unwrap(model) if unwrap is not None else model
    module = find_input_embeddings(inner)
    compiled = is_compiled(inner)
    handle = module.register_forward_hook(hook)
    if compiled:
        _forget_compiled_code()
    try:
        yield module
    finally:
        handle.remove()
        if compiled:
            _forget_compiled_code()


def _forget_compiled_code() -> None:
    # Dynamo does not guard on a module's hook dicts (torch._dynamo.config.skip_nnmodule_hook_guards): code
    # compiled before the hook came (or went) would keep running without it (or with it). Dropping the compiled
    # code makes the next forward compile again with the hooks as they are now (other compiled code in the
    # process recompiles too, once).
    torch.compiler.reset()
