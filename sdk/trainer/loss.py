"""Exact loss under gradient accumulation and data parallelism.

The loss of an optimizer step is the sum of every token's loss in the window (all micro-batches on
all ranks) divided by the number of label tokens in that whole window. A model forward that returns
the *mean* over its own micro-batch weights a short micro-batch's tokens more than a long one's
(github.com/huggingface/transformers/issues/34242). Three ways to get it right, in order of preference:

1. the Trainer owns the loss (``compute_loss_func``, label smoothing): it computes ``sum / N`` from
   the logits itself;
2. the forward accepts ``num_items_in_batch`` (by name or through ``**kwargs``): it gets ``N``;
3. the model's mean is known to be over its micro-batch's label tokens (shardkit's Llama): the mean is
   scaled back to a sum with the local count.

Otherwise the Trainer warns once, naming the model, and averages the micro-batch means.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LossMode", "LossSettings", "count_label_items", "is_causal_lm", "logits_of", "loss_from_logits",
           "loss_mode", "loss_of"]

logger = logging.getLogger("shardkit.trainer")

IGNORE_INDEX = -100


class LossMode:
    OWN = "own"  # the Trainer computes sum / N from the logits
    NUM_ITEMS = "num_items"  # the forward takes num_items_in_batch and returns sum / N
    RESCALE = "rescale"  # the forward returns the mean over its label tokens; scaled by local / N
    MEAN = "mean"  # nothing better is possible: micro-batch means averaged (warned once)


def _forward_parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return {}


def accepts(module: nn.Module, name: str) -> bool:
    """True when ``module.forward`` takes ``name`` by name or through ``**kwargs``."""
    params = _forward_parameters(module)
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def is_causal_lm(module: nn.Module) -> bool:
    """True for models that shift labels inside (next-token prediction): HF ``*ForCausalLM`` and shardkit's Llama."""
    from shardkit.models import Llama

    if isinstance(module, Llama):
        return True
    if getattr(module, "loss_type", None) == "ForCausalLM":
        return True
    return type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _mean_is_over_label_tokens(module: nn.Module) -> bool:
    # Models whose returned loss is documented as the mean over their non-ignored (shifted) labels.
    from shardkit.models import Llama

    return isinstance(module, Llama)


def loss_mode(module: nn.Module, owns_loss: bool) -> str:
    """How the Trainer gets an exact window loss from ``module`` (see the module docstring)."""
    if owns_loss:
        return LossMode.OWN
    if accepts(module, "num_items_in_batch") and getattr(module, "accepts_loss_kwargs", True):
        return LossMode.NUM_ITEMS
    if _mean_is_over_label_tokens(module):
        return LossMode.RESCALE
    return LossMode.MEAN


def count_label_items(labels: torch.Tensor | None, shift: bool) -> int:
    """Label items that carry loss in one micro-batch: non-ignored labels, after the shift for causal LMs."""
    if labels is None:
        return 0
    if shift:
        labels = labels[..., 1:]
    if labels.is_floating_point():
        return labels.shape[0]  # regression: one item per sample
    return int((labels != IGNORE_INDEX).sum())


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor, num_items: Any, shift: bool,
                     label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy over non-ignored labels divided by ``num_items`` (the whole window's count)."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1).to(logits.device)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                            label_smoothing=label_smoothing)
    return total / num_items


def warn_mean_once(model_name: str, _seen: set[str] = set()) -> None:  # noqa: B006 - a deliberate once-set
    if model_name in _seen:
        return
    _seen.add(model_name)
    logger.warning(
        "%s.forward neither accepts num_items_in_batch nor returns logits the Trainer can take the loss of, so "
        "micro-batches of different label counts are weighted equally under gradient accumulation (the loss is "
        "not exactly the big batch's). Add `num_items_in_batch=None` (or **kwargs) to its forward and return "
        "sum / num_items_in_batch, or pass compute_loss_func to the Trainer", model_name)


def loss_of(outputs: Any) -> torch.Tensor:
    """The loss a model's forward returned: the tensor itself, a mapping's ``"loss"``, or a tuple's first item."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        if outputs.get("loss") is None:
            raise ValueError(f"the model returned no loss (keys {list(outputs)}); pass labels or compute_loss_func")
        return outputs["loss"]
    return outputs[0]


def logits_of(outputs: Any, ignore_keys: list[str] | None, has_loss: bool = False) -> Any:
    """The prediction tensors of a forward's outputs (a mapping's tensors but the loss, caches, hidden states,
    attentions and ``ignore_keys``; a tuple's items after the loss): one tensor, a tuple of them, or None."""
    if isinstance(outputs, torch.Tensor):
        return None if outputs.ndim == 0 else outputs
    if isinstance(outputs, Mapping):
        skip = set(ignore_keys or []) | {"loss", "past_key_values", "hidden_states", "attentions"}
        values = tuple(v for k, v in outputs.items() if k not in skip and isinstance(v, torch.Tensor))
    else:
        values = tuple(outputs[1:] if has_loss else outputs)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class LossSettings:
    """How the Trainer turns each micro-batch's loss into its exact share of the window's (the module docstring):
    the Trainer holds one as ``trainer.loss_settings``; training, ``compute_loss`` and ``prediction_step`` read it.

    Attributes:
        mode: the :class:`LossMode` of the model (set again by :meth:`set_model` when the model changes).
        shift_labels: the model shifts labels inside (a causal LM), so each row's first label carries no loss.
        takes_items: ``compute_loss`` takes ``num_items_in_batch`` (an override with Hugging Face's old signature
            returns a micro-batch mean instead); read once, not per step.
        window_len: micro-batches in the accumulation window being trained.
        window_items: label items of that window on all ranks (at least 1).
    """

    def __init__(self, runner: Any, average_across_devices: bool, takes_items: bool):
        self.runner, self.average_across_devices, self.takes_items = runner, average_across_devices, takes_items
        self.mode, self.shift_labels = LossMode.MEAN, False
        self.window_len, self.window_items = 1, 1

    def set_model(self, model: nn.Module, owns_loss: bool) -> None:
        """Read the mode and the label shift from ``model`` (a PeftModel's base model, which says what it takes)."""
        self.mode = loss_mode(model, owns_loss)
        self.shift_labels = is_causal_lm(model)

    @property
    def data_parallel_size(self) -> int:
        return self.runner.strategy.data_parallel_size

    @property
    def backward_scale(self) -> int:
        """What a loss normalised by the whole window's count is multiplied by before backward: the Runner divides
        by the window length and data parallelism averages over ranks."""
        ranks = self.data_parallel_size if self.average_across_devices else 1
        return self.window_len * ranks

    def count_window(self, window: list[Any], label: str) -> torch.Tensor:
        """Label items of the whole window: this rank's micro-batches, summed over ranks (one all-reduce)."""
        runner = self.runner
        local = sum(count_label_items(b.get(label) if isinstance(b, Mapping) else None, self.shift_labels)
                    for b in window)
        count = torch.tensor([float(local)], dtype=torch.float64, device=runner.device)
        if self.average_across_devices and runner.world_size > 1:
            count = runner.all_reduce(count, "sum") * (self.data_parallel_size / runner.world_size)
        self.window_items = max(int(round(count.item())), 1)
        return torch.tensor(self.window_items, device=runner.device)
