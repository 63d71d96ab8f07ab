"""The Trainer's choice fields as string enums with Hugging Face's names and values.

Each member is a ``str``: ``IntervalStrategy.EPOCH == "epoch"``, it prints as ``epoch`` and JSON writes it as
``"epoch"``. :func:`coerce` turns whatever a user passes (a member of these enums, of transformers' own enums
of the same names, or a string in any case) into the member, or raises naming the field and the choices.
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Any, TypeVar

from shardkit.utils.suggest import did_you_mean

__all__ = ["DebugOption", "HubStrategy", "IntervalStrategy", "SaveStrategy", "SchedulerType", "coerce"]


class IntervalStrategy(StrEnum):
    """When to log or evaluate: never, every ``*_steps`` optimizer steps, or at each epoch end."""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


class SaveStrategy(StrEnum):
    """When to save: as :class:`IntervalStrategy`, or ``best`` (after an evaluation that improved the metric)."""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"
    BEST = "best"


class HubStrategy(StrEnum):
    """What ``push_to_hub`` uploads and when (Hugging Face's names)."""

    END = "end"
    EVERY_SAVE = "every_save"
    CHECKPOINT = "checkpoint"
    ALL_CHECKPOINTS = "all_checkpoints"


class SchedulerType(StrEnum):
    """Learning-rate schedules by Hugging Face's ``lr_scheduler_type`` names (see ``shardkit.trainer.schedulers``)."""

    LINEAR = "linear"
    COSINE = "cosine"
    COSINE_WITH_RESTARTS = "cosine_with_restarts"
    POLYNOMIAL = "polynomial"
    CONSTANT = "constant"
    CONSTANT_WITH_WARMUP = "constant_with_warmup"
    INVERSE_SQRT = "inverse_sqrt"
    REDUCE_ON_PLATEAU = "reduce_lr_on_plateau"
    COSINE_WITH_MIN_LR = "cosine_with_min_lr"
    COSINE_WARMUP_WITH_MIN_LR = "cosine_warmup_with_min_lr"
    WARMUP_STABLE_DECAY = "warmup_stable_decay"
    GREEDY = "greedy"


class DebugOption(StrEnum):
    """``debug=`` options: ``underflow_overflow`` stops at the first module output holding inf or NaN."""

    UNDERFLOW_OVERFLOW = "underflow_overflow"
    TPU_METRICS_DEBUG = "tpu_metrics_debug"


E = TypeVar("E", bound=StrEnum)


def coerce(enum: type[E], field: str, value: Any, owner: str = "TrainingArguments") -> E:
    """``value`` as a member of ``enum``: a member, any ``Enum`` with the same value, or a string (any case).

    Raises:
        ValueError: not one of the enum's values; the message names the field, the value and the choices.
    """
    if isinstance(value, Enum):
        value = value.value
    text = value.strip().lower() if isinstance(value, str) else value
    try:
        return enum(text)
    except ValueError:
        valid = [m.value for m in enum]
        shown = value if isinstance(value, (str, int, float, bool, type(None))) else f"a {type(value).__name__}"
        raise ValueError(f"{owner}.{field}={shown!r} is not valid{did_you_mean(str(text), valid)} "
                         f"Use one of {valid}") from None
