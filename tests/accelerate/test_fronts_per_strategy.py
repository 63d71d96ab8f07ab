"""Both fronts name every registered strategy's kind from what it declares (``Strategy.family``), never its class:
shardkit.Accelerator's ``distributed_type`` (Accelerate's) and the Trainer's ``is_fsdp_enabled`` /
``is_deepspeed_enabled`` (and its ``trainer.accelerator.distributed_type``), in one process.

ContextParallel and Pipeline are included: Accelerate's name for them came from a table of registry names that
lacked both, so ``distributed_type`` raised ValueError under them. On 2 ranks the contract suite checks the same
(tests/contract: ``test_set_up_strategy_keeps_its_facts_and_accelerate_reports_its_family``).
"""

from __future__ import annotations

import pytest
from torch import nn

import shardkit.accelerate_compat.accelerator as front
from shardkit import Accelerator
from shardkit.strategies.registry import STRATEGIES

pytest.importorskip("deepspeed")  # four registered strategies are DeepSpeed's engine
pytest.importorskip("transformers")

# In one process (world size 1), as Accelerate names them: a world of one without FSDP2 or DeepSpeed is NO; FSDP2
# sharding (FSDP, ContextParallel: FSDP over dp_shard x cp) is FSDP even there, as are TP's and Pipeline's
# dp="fsdp"; DeepSpeed's engines are DEEPSPEED.
ONE_PROCESS = {
    ("single", ()): "NO", ("ddp", ()): "NO", ("fsdp", ()): "FSDP", ("tp", ()): "NO", ("cp", ()): "FSDP",
    ("pp", ()): "NO", ("zero1", ()): "DEEPSPEED", ("zero2", ()): "DEEPSPEED", ("zero3", ()): "DEEPSPEED",
    ("zero_infinity", ()): "DEEPSPEED", ("tp", (("dp", "fsdp"),)): "FSDP", ("pp", (("dp", "fsdp"),)): "FSDP",
}


def fronts(strategy_name: str, monkeypatch, tmp_path, **options) -> dict:
    """What each front says under ``STRATEGIES.build(strategy_name, **options)``: the Accelerator (which takes its
    strategy from the launcher's environment, here the one built) and the Trainer given the strategy."""
    from shardkit.trainer import Trainer, TrainingArguments

    monkeypatch.setattr(front, "default_strategy", lambda cpu=False, ddp=None: STRATEGIES.build(strategy_name,
                                                                                                 **options))
    accelerator = Accelerator(cpu=True)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(nn.Linear(2, 2), args, strategy=STRATEGIES.build(strategy_name, **options))
    return {"accelerator": str(accelerator.distributed_type), "state": str(accelerator.state.distributed_type),
            "is_fsdp_enabled": trainer.is_fsdp_enabled, "is_deepspeed_enabled": trainer.is_deepspeed_enabled,
            "trainer.accelerator": str(trainer.accelerator.distributed_type)}


# A strategy registered without a row above is held to what a world of one makes of its declared family.
_ONE_PROCESS_BY_FAMILY = {"single": "NO", "data_parallel": "NO", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}
CASES = [*ONE_PROCESS, *((name, ()) for name in STRATEGIES.names() if (name, ()) not in ONE_PROCESS)]


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}{''.join(f'-{k}={v}' for k, v in o)}" for n, o in CASES])
def test_both_fronts_name_the_strategy_as_accelerate_does(name, options, monkeypatch, tmp_path):
    got = fronts(name, monkeypatch, tmp_path, **dict(options))
    want = ONE_PROCESS.get((name, options)) or _ONE_PROCESS_BY_FAMILY[STRATEGIES.build(name).family.value]
    assert got == {"accelerator": want, "state": want, "is_fsdp_enabled": want == "FSDP",
                   "is_deepspeed_enabled": want == "DEEPSPEED", "trainer.accelerator": want}, (name, options, got)
