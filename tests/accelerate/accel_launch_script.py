"""Run by ``accelerate launch`` in test_accelerate_launch_env.py: a tiny shardkit.Accelerator training loop that
writes what the job ran as (its distributed type, strategy, settings) and its losses to ``$OUT_DIR/rank<r>.json``.

    accelerate launch --config_file fsdp.yaml --num_processes 2 accel_launch_script.py OUT_DIR

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
    main(sys.argv[1])
