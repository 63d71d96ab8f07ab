"""A DeepSpeed config's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``) as shardkit trackers.

DeepSpeed's engine writes its monitor's records itself; here the sections become trackers of
:data:`~shardkit.observability.trackers.TRACKERS`
that the Runner builds on its main process and writes the same records to
(the loss, learning rate and loss scale at each optimizer step, with the samples trained as the step). Paths
follow DeepSpeed's: ``<output_path>/<job_name>`` (``output_path`` defaults to the working directory, ``job_name``
to ``DeepSpeedJobName``). The CSV files differ in layout: one ``metrics.csv`` with a column per record instead of
DeepSpeed's file per record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.config.common import ConfigError
from shardkit.observability.trackers import TrackerSpec

__all__ = ["trackers_from_deepspeed"]

_JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default job_name (deepspeed/monitor/config.py)
_WANDB_PROJECT = "deepspeed"  # DeepSpeed's default W&B project


def trackers_from_deepspeed(raw: Mapping[str, Any], where: str) -> tuple[TrackerSpec, ...]:
    """One :class:`TrackerSpec` per enabled monitor section of a DeepSpeed config (keys already checked).

    Raises:
        ConfigError: a section's value has the wrong type (named with the file and the key).
    """
    specs = []
    for section, tracker in (("tensorboard", "tensorboard"), ("csv_monitor", "csv")):
        values = _section(raw, section, where)
        if values.get("enabled"):
            specs.append(TrackerSpec(tracker, run_name=_text(values, "job_name", _JOB_NAME, section, where),
                                     logging_dir=_text(values, "output_path", "", section, where) or ".",
                                     source=f"{where}: {section}"))
    values = _section(raw, "wandb", where)
    if values.get("enabled"):
        options = {"group": values.get("group"), "entity": values.get("team")}
        specs.append(TrackerSpec("wandb", run_name=_text(values, "project", _WANDB_PROJECT, "wandb", where),
                                 logging_dir=".", options={k: v for k, v in options.items() if v is not None},
                                 source=f"{where}: wandb"))
    return tuple(specs)


def _section(raw: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    values = raw.get(name) or {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: {name} must be an object such as {{\"enabled\": true}}, "
                          f"got {type(values).__name__}")
    return values


def _text(values: Mapping[str, Any], key: str, default: str, section: str, where: str) -> str:
    value = values.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {section}.{key} must be a string, got {type(value).__name__}")
    return value
