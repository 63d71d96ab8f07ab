"""Metrics for people and files, behind the Trainer's ``metrics_format``, ``log_metrics``, ``save_metrics`` and
``save_state`` (Hugging Face's helpers): what to print, and the JSON files written in ``output_dir``.

``all_results.json`` is read back to merge into: through ``config.common.load_mapping`` (a regular file of at
most ``MAX_CONFIG_BYTES`` holding a JSON object), so a damaged or foreign file is refused by name, not replaced.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shardkit.trainer.state import TRAINER_STATE_NAME

__all__ = ["format_metrics", "print_metrics", "write_metrics", "write_state"]


def _human(key: str, value: Any) -> Any:
    if isinstance(value, float) and ("_runtime" in key or key.endswith("_per_second")):
        return round(value, 4)
    if key.endswith("_mem_cpu_alloc_delta") or "_mem_" in key:
        return f"{value >> 20}MB" if isinstance(value, int) else value
    if key == "total_flos" and isinstance(value, (int, float)) and value > 0:
        return f"{value / 2**30:.0f}GF"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def format_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics as people read them: runtimes rounded, memory in MB, flos in GF."""
    return {k: _human(k, v) for k, v in metrics.items()}


def print_metrics(split: str, shown: dict[str, Any]) -> None:
    """Print formatted metrics under a ``***** <split> metrics *****`` header, sorted by name."""
    width = max((len(k) for k in shown), default=0)
    lines = [f"***** {split} metrics *****"] + [f"  {k:<{width}} = {shown[k]!s:>9}" for k in sorted(shown)]
    print("\n".join(lines))


def write_metrics(output_dir: str | Path, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
    """Write ``<output_dir>/<split>_results.json``; with ``combined``, merge them into ``all_results.json``.

    Raises:
        ConfigError: the ``all_results.json`` there is not a regular file, too large, not JSON or not an object.
    """
    from shardkit.config.common import load_mapping

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True, default=str))
    if combined:
        path = out / "all_results.json"
        merged = load_mapping(path) if path.exists() else {}
        merged.update(metrics)
        path.write_text(json.dumps(merged, indent=4, sort_keys=True, default=str))


def write_state(output_dir: str | Path, state: Any) -> None:
    """Write a TrainerState to ``<output_dir>/trainer_state.json``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state.save_to_json(out / TRAINER_STATE_NAME)
