"""The DeepSpeed seed's configs run as the page writes them (issue 23): its notebook ds_config_zero3.json (CPU
offload, WarmupLR with "auto" values: DeepSpeed 0.19.6+ refused the warmup_num_steps=0 it was filled with) and its
ZeRO-2 and ZeRO-1 sections, through the Trainer with default TrainingArguments; the loss falls under each. After the
ZeRO-3 run its fp32 snippets run as written: load_state_dict_from_zero_checkpoint(trainer.model, checkpoint_dir) into
the still partitioned model, and `cd checkpoint-N; python zero_to_fp32.py . pytorch_model.bin` with the script the
checkpoint carries; its FLOPs count the partitioned weights whole, and its mfu divides by the peak the user set."""

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
    zero3 = result.pop("zero3")
    for path, losses in result.items():
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), (path, losses)
        assert losses[-1] < losses[0], (path, losses)
    assert zero3["checkpoint"] == "checkpoint-4" and zero3["same_model"], zero3
    assert zero3["loss_after"] == zero3["loss_before"], zero3  # every scrambled weight came back from the checkpoint
    assert zero3["script"][0] == 0 and zero3["loaded_equals_export"], zero3
    assert zero3["flops"] == zero3["single_device_flops"] > 0 and zero3["peak"] == w.PEAK, zero3
