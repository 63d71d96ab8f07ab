"""Adding a strategy is one class and one register line: a strategy registered here (added_strategy.AddedFSDP, a
subclass of FSDP under a new name) is estimated by ``shardkit estimate-memory``'s code, named by both fronts and run
through the contract suite's checks of facts, training and resume, with no other file touched; unregistered at the
end.

The contract's tests are test_strategy_contract.py's own, imported: this module only overrides the strategy they
run on (the ``strategy_name`` fixture).
"""

from __future__ import annotations

import pytest
from added_strategy import NAME, TARGET

# NOTE: the contract's checks that a subclass could break by its registration alone (facts, training, resume);
# the rest run on FSDP itself in test_strategy_contract.py, and each costs a 2-rank FSDP job in CI.
from test_strategy_contract import (  # noqa: F401  (the contract's tests and fixture, run here on NAME)
    contract,
    test_accumulation_and_clipping_equal_ddp,
    test_declares_the_facts_fronts_and_tools_ask,
    test_fp32_losses_equal_ddp,
    test_save_then_exact_resume,
    test_set_up_strategy_keeps_its_facts_and_accelerate_reports_its_family,
)
from torch import nn

from shardkit.strategies.registry import STRATEGIES


@pytest.fixture(scope="module")
def strategy_name():
    """NAME registered for this module's tests (the one line a new strategy adds to strategies/registry.py)."""
    assert NAME not in STRATEGIES
    STRATEGIES.register(NAME, TARGET, description="FSDP2 under another name (tests only)")
    try:
        yield NAME
    finally:
        STRATEGIES.unregister(NAME)


def test_the_registry_line_gives_the_class_and_unregistering_takes_it_back(strategy_name):
    from added_strategy import AddedFSDP

    import shardkit

    assert shardkit.AddedFSDP is AddedFSDP and STRATEGIES.build(strategy_name).family.value == "fsdp"
    STRATEGIES.unregister(strategy_name)
    try:
        assert strategy_name not in STRATEGIES and "AddedFSDP" not in STRATEGIES
        with pytest.raises(AttributeError):
            shardkit.AddedFSDP  # noqa: B018
    finally:
        STRATEGIES.register(NAME, TARGET, description="FSDP2 under another name (tests only)")


def test_estimate_memory_estimates_it_by_the_formula_it_inherits(strategy_name, capsys):
    from shardkit.cli import main
    from shardkit.memory import ModelSpec, estimate_model_states

    spec = ModelSpec(7_000_000_000, 131_000_000)
    for precision in ("bf16", "fp32"):
        added = estimate_model_states(spec, strategy_name, num_gpus_per_node=8, precision=precision)
        fsdp = estimate_model_states(spec, "fsdp", num_gpus_per_node=8, precision=precision)
        assert added.strategy == strategy_name and added.device_peak > 0
        assert {**added.__dict__, "strategy": "fsdp"} == fsdp.__dict__
    assert main(["estimate-memory", "--params", "7B", "--largest-layer-params", "131M", "--num-gpus", "8"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows[strategy_name] == rows["fsdp"], rows  # listed under --strategy all, with FSDP's numbers
    assert main(["estimate-memory", "--params", "7B", "--num-gpus", "8", "--strategy", strategy_name]) == 0
    assert f"\n{strategy_name} " in capsys.readouterr().out


def test_both_fronts_name_it_by_its_declared_family(strategy_name, monkeypatch, tmp_path):
    """In one process; on 2 ranks the contract's facts check (imported above) holds Accelerate's front to FSDP."""
    import shardkit.accelerate_compat.accelerator as front
    from shardkit import Accelerator
    from shardkit.trainer import Trainer, TrainingArguments

    pytest.importorskip("transformers")
    monkeypatch.setattr(front, "default_strategy", lambda cpu=False, ddp=None: STRATEGIES.build(strategy_name))
    assert str(Accelerator(cpu=True).distributed_type) == "FSDP"
    trainer = Trainer(nn.Linear(2, 2), TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                      strategy=STRATEGIES.build(strategy_name))
    assert trainer.is_fsdp_enabled and not trainer.is_deepspeed_enabled
    assert str(trainer.accelerator.distributed_type) == "FSDP"
