"""Issue 13: keys accepted without effect warn once, naming what to use instead; the resolved config is logged."""

from __future__ import annotations

import json
import logging

import pytest

from shardkit.config import common, resolve_runner_config


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(common, "_WARNED", set())


FSDP_YAML = """distributed_type: FSDP
num_processes: 2
fsdp_config:
  fsdp_backward_prefetch: NO_PREFETCH
  fsdp_forward_prefetch: true
  fsdp_use_orig_params: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
"""


@pytest.mark.parametrize(("text", "suffix", "needles"), [
    (FSDP_YAML, ".yaml", ["set_modules_to_backward_prefetch", "set_modules_to_forward_prefetch",
                          "fsdp_use_orig_params: false has no effect"]),
    (json.dumps({"activation_checkpointing": {"partition_activations": True},
                 "checkpoint": {"use_node_local_storage": True}}), ".json",
     ["activation_checkpointing.partition_activations=True has no effect", "use_node_local_storage has no effect"]),
    ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n  zero3_init_flag: true\n",
     ".yaml", ["zero3_init_flag: true has no effect by itself", "runner.init_module()"]),
])
def test_keys_without_effect_warn_once_naming_the_alternative(tmp_path, caplog, text, suffix, needles):
    path = tmp_path / f"config{suffix}"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="shardkit.config"):
        resolve_runner_config(path, world_size=2)
        first = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        caplog.clear()
        resolve_runner_config(path, world_size=2)
        second = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "has no" in r.getMessage()]

    for needle in needles:
        assert sum(needle in message for message in first) == 1, (needle, first)
    assert not any(any(needle in message for message in second) for needle in needles)  # once per process


def test_fsdp2_matching_values_do_not_warn(tmp_path, caplog):
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_backward_prefetch: BACKWARD_PRE\n"
                    "  fsdp_forward_prefetch: false\n  fsdp_use_orig_params: true\n")
    with caplog.at_level(logging.WARNING, logger="shardkit.config"):
        resolve_runner_config(path, world_size=2)

    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


def test_the_resolved_config_is_logged_once_on_rank_0(tmp_path, caplog, monkeypatch):
    import shardkit.config as config

    monkeypatch.setattr(config, "_LOGGED", set())
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "gradient_accumulation_steps": 2}))
    with caplog.at_level(logging.INFO, logger="shardkit.config"):
        resolve_runner_config(path, world_size=2)
        resolve_runner_config(path, world_size=2)
        monkeypatch.setenv("RANK", "1")
        config._LOGGED.clear()
        resolve_runner_config(path, world_size=2)

    lines = [r.getMessage() for r in caplog.records if "resolves to" in r.getMessage()]
    assert len(lines) == 1 and "gradient_accumulation_steps=2" in lines[0] and "max_grad_norm=1.0" in lines[0]
