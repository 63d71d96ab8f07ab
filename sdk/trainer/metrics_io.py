"""Metrics for people and files: ``log_metrics``, ``save_metrics``, ``save_state`` (Hugging Face's helpers)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shardkit.trainer.state import TRAINER_STATE_NAME

__all__ = ["MetricsIOMixin"]


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


class MetricsIOMixin:
    """log_metrics, metrics_format, save_metrics and save_state; mixed into Trainer."""

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The metrics as people read them: runtimes rounded, memory in MB, flos in GF."""
        return {k: _human(k, v) for k, v in metrics.items()}

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` under a ``***** <split> metrics *****`` header, on the main process."""
        if not self.is_world_process_zero():
            return
        shown = self.metrics_format(metrics)
        width = max((len(k) for k in shown), default=0)
        lines = [f"***** {split} metrics *****"] + [f"  {k:<{width}} = {shown[k]!s:>9}" for k in sorted(shown)]
        print("\n".join(lines))

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``<output_dir>/<split>_results.json`` (and merge into ``all_results.json``), on the main process."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True, default=str))
        if combined:
            path = out / "all_results.json"
            merged: dict[str, Any] = {}
            if path.is_file():
                try:
                    loaded = json.loads(path.read_text())
                    merged = loaded if isinstance(loaded, dict) else {}
                except (OSError, json.JSONDecodeError):
                    merged = {}
            merged.update(metrics)
            path.write_text(json.dumps(merged, indent=4, sort_keys=True, default=str))

    def save_state(self) -> None:
        """Write the TrainerState to ``<output_dir>/trainer_state.json``, on the main process."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.state.save_to_json(out / TRAINER_STATE_NAME)
