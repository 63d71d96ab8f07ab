"""DeepSpeed's learning-rate schedulers (``deepspeed.runtime.lr_schedules``), built from a config's section.

A DeepSpeed config's ``scheduler`` section names one of DeepSpeed's own classes (WarmupLR, WarmupDecayLR,
OneCycle, ...). They step a plain torch optimizer, under any strategy; they are built here because this
package is the one place that imports DeepSpeed (:func:`shardkit.config.optim.build_scheduler` calls it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["deepspeed_scheduler"]


def deepspeed_scheduler(spec: Mapping[str, Any], optimizer: Any) -> Any:
    """An instance of ``deepspeed.runtime.lr_schedules.<spec["type"]>`` over ``optimizer`` with
    ``spec["params"]`` (a section already resolved and checked by :mod:`shardkit.config.optim`)."""
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, spec["type"])(optimizer, **spec["params"])
