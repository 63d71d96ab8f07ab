"""Optimizers that update inside backward (LOMO, AdaLomo, layer-wise GaLore) are refused by name on 2 ranks.

Under DDP each parameter would be updated from its local gradient before the all-reduce (lomo-optim's
ordinary path never all-reduces; layer-wise steps in the post-accumulate hook), so the ranks would drift;
FSDP replaces the parameters the hooks are on. One process group checks every combination.
"""

from pathlib import Path

import torch
from harness import run_distributed
from torch.utils.data import Subset
from workloads import TEXT

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.strategies import strategy_from_name
from shardkit.trainer import Trainer, TrainingArguments
from shardkit.trainer.backward_step import BackwardStepError

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)
ROWS = {"adalomo": {}, "galore_adamw_layerwise": dict(optim_target_modules="all-linear")}


def _refusals(out: str) -> dict[str, str]:
    data = Subset(ByteTextDataset(TEXT, seq_len=16, stride=16), range(16))
    found = {}
    # One fused-backward row (lomo is the same kind; its package import would cost a rank seconds) and the
    # layer-wise one under DDP, and a fused-backward one under FSDP.
    for strategy, optim in [("ddp", "adalomo"), ("ddp", "galore_adamw_layerwise"), ("fsdp", "adalomo")]:
        extra = ROWS[optim]
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=str(Path(out) / f"{strategy}-{optim}"), optim=optim, max_steps=2,
                                 per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True,
                                 max_grad_norm=0.0, **extra)
        trainer = Trainer(Llama(TINY), args, train_dataset=data, strategy=strategy_from_name(strategy))
        try:
            trainer.train()
            found[f"{strategy}/{optim}"] = "trained"
        except BackwardStepError as err:
            found[f"{strategy}/{optim}"] = str(err)
    return found


def test_ddp_and_fsdp_refuse_backward_step_optimizers_by_name(tmp_path):
    for found in run_distributed(_refusals, 2, args=(str(tmp_path),)):
        assert len(found) == 3
        for key, message in found.items():
            strategy = key.split("/")[0].upper()
            assert "one process only" in message and f"not {strategy} with world size 2" in message, (key, message)
