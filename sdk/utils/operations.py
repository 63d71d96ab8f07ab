"""Small operations on user data that several packages need: a batch moved to a device, a batch's size,
a "dict or JSON object" argument read into a dict. One copy each, here (Accelerate keeps its own in
``utils/operations.py``), so that they do not drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["batch_size", "json_object", "move_to_device"]


def move_to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor in a (nested) batch moved to ``device``; other values pass through.

    Mappings, named tuples, lists and tuples keep their type. ``non_blocking`` suits host-to-device
    copies of a loader's (pinned) batches; leave it off for copies to the host that are read at once.
    """
    import torch  # NOTE: here, not at the top: `shardkit.utils.registry` imports this module for `json_object`

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (a mapping's first value, a sequence's
    first item, recursively); 1 for anything else (a 0-d tensor, a scalar, an empty container)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        return batch_size(next(iter(batch.values()))) if batch else 1
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return batch_size(batch[0]) if len(batch) else 1
    return 1


def json_object(value: Any, where: str, fix: str = "pass a dict or a JSON object",
                error: type[Exception] = ValueError) -> dict[str, Any]:
    """``value`` as a dict: a mapping (copied), or a string holding a JSON object.

    Args:
        value: what the user gave.
        where: how messages name it (``"optim_args='...'"``, ``"TrainingArguments.deepspeed"``).
        fix: what the user should do instead, appended to every message.
        error: the exception class raised (a ValueError subclass of the caller's, e.g.).

    Raises:
        ``error``: text that is not valid JSON, JSON that is not an object, or a value of another type.
    """
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (str, bytes, bytearray)):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise error(f"{where} is not valid JSON ({err}): {fix}") from None
        if isinstance(parsed, dict):
            return parsed
        raise error(f"{where} must be a JSON object, not a JSON {type(parsed).__name__}: {fix}")
    raise error(f"{where} must be a dict or a JSON object, not {type(value).__name__}: {fix}")
