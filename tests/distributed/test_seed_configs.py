"""The DeepSpeed seed's configs run as the page writes them (issue 23): its notebook ds_config_zero3.json (CPU
offload, WarmupLR with "auto" values: DeepSpeed 0.19.6+ refused the warmup_num_steps=0 it was filled with) and its
ZeRO-2 and ZeRO-1 sections, through the Trainer with default TrainingArguments; the loss falls under each."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import seed_workers as w
from harness import run_distributed

pytest.importorskip("deepspeed")

SEEDS = Path(__file__).resolve().parents[1] / "seeds"


def test_the_deepspeed_seeds_configs_train_with_default_arguments(tmp_path):
    configs = [str(SEEDS / name) for name in ("ds_config_zero3.json", "ds_config_zero2.json", "ds_config_zero1.json")]
    (result,) = run_distributed(w.seed_config_worker, world_size=1, args=(configs, str(tmp_path)), timeout=600)
    for path, losses in result.items():
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), (path, losses)
        assert losses[-1] < losses[0], (path, losses)
