"""Run by ``accelerate launch`` in test_accelerate_launch_env.py: a tiny shardkit.Accelerator training loop (or,
with ``trainer``, the same model through shardkit's Trainer) that writes what the job ran as (its distributed type,
strategy, settings) and its losses to ``$OUT_DIR/rank<r>.json``.

    accelerate launch --config_file fsdp.yaml --num_processes 2 accel_launch_script.py OUT_DIR [trainer]

With a DeepSpeed config that has optimizer/scheduler sections it passes DummyOptim/DummyScheduler, choosing them
as Accelerate's examples do (``"optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config``).
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardkit import Accelerator
from shardkit.accelerate_compat import DummyOptim, DummyScheduler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Regression(nn.Module):
    """The model with Hugging Face's calling convention, for the Trainer: a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(Block(), Block(), nn.Linear(8, 1))

    def forward(self, inputs, labels=None):
        prediction = self.net(inputs)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


def train_with_trainer(out_dir: str) -> None:
    from shardkit.trainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    rows = [{"inputs": a, "labels": a.sum(dim=0, keepdim=True) * 0.5} for a in x]
    args = TrainingArguments(output_dir=str(Path(out_dir, "run")), per_device_train_batch_size=8, num_train_epochs=4,
                             learning_rate=0.05, lr_scheduler_type="constant", logging_strategy="epoch",
                             save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=rows)
    trainer.train()
    strategy = trainer.runner.strategy
    record = {"distributed_type": str(trainer.accelerator.distributed_type), "strategy": type(strategy).__name__,
              "settings": repr(getattr(strategy, "settings", None)), "is_fsdp_enabled": trainer.is_fsdp_enabled,
              "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
              "num_processes": trainer.runner.world_size}
    Path(out_dir, f"rank{trainer.runner.rank}.json").write_text(json.dumps(record))


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 1))
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5)
    accelerator = Accelerator()
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and "optimizer" in plugin.deepspeed_config:  # as Accelerate's examples choose DummyOptim
        optimizer = DummyOptim(model.parameters(), lr=0.05)
        scheduler = DummyScheduler(optimizer, warmup_num_steps=1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8),
                                                              scheduler)
    losses = []
    for _ in range(4):
        total = 0.0
        for inputs, target in loader:
            loss = nn.functional.mse_loss(model(inputs), target)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(total)
    strategy = accelerator.runner.strategy
    record = {"distributed_type": str(accelerator.distributed_type), "strategy": type(strategy).__name__,
              "settings": repr(getattr(strategy, "settings", None)), "losses": losses,
              "lr": optimizer.param_groups[0]["lr"], "num_processes": accelerator.num_processes}
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    if sys.argv[2:] == ["trainer"]:
        train_with_trainer(sys.argv[1])
    else:
        main(sys.argv[1])
