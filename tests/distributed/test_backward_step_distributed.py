"""Optimizers that update inside backward on 2 ranks (one process group for every check).

- LOMO and AdaLomo under DDP: DDP's sync is off and each gradient is averaged across ranks in the hook
  before the update, so LOMO equals SGD under DDP, with the schedule's lr and clipping, and the ranks'
  weights stay bitwise equal.
- Layer-wise GaLore under DDP and AdaLomo under FSDP are refused by name (the update would run before
  DDP's all-reduce; FSDP replaces the parameters the hooks are on).
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

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16, fused=False)


def _trainer(out: Path, strategy: str, optim: str, **kw) -> Trainer:
    data = Subset(ByteTextDataset(TEXT, seq_len=16, stride=16), range(32))
    base = dict(output_dir=str(out / f"{strategy}-{optim}"), optim=optim, max_steps=4, logging_steps=1,
                per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True, learning_rate=0.2,
                weight_decay=0.0, max_grad_norm=0.0, warmup_steps=1, seed=0)
    torch.manual_seed(0)
    return Trainer(Llama(TINY), TrainingArguments(**{**base, **kw}), train_dataset=data,
                   strategy=strategy_from_name(strategy))


def _worker(out: str) -> dict:
    out = Path(out)
    result: dict = {}
    # fused=False model: with max_grad_norm the norm is measured by a backward that keeps the graph.
    lomo = _trainer(out, "ddp", "lomo", max_grad_norm=0.5)
    lomo.train()
    sgd = _trainer(out, "ddp", "sgd", max_grad_norm=0.5)
    sgd.train()
    result["lomo_vs_sgd"] = max((a - b).abs().max().item() for a, b in
                                zip(lomo.model.parameters(), sgd.model.parameters()))
    adalomo = _trainer(out, "ddp", "adalomo", learning_rate=0.05)
    adalomo.train()
    losses = [h["loss"] for h in adalomo.state.log_history if "loss" in h]
    result["adalomo_losses"] = losses
    result["weights"] = {name: p.detach().clone() for name, p in adalomo.model.named_parameters()}
    for strategy, optim, extra in [("ddp", "galore_adamw_layerwise", dict(optim_target_modules="all-linear")),
                                   ("fsdp", "adalomo", {})]:
        try:
            _trainer(out, strategy, optim, **extra).train()
            result[f"{strategy}/{optim}"] = "trained"
        except BackwardStepError as err:
            result[f"{strategy}/{optim}"] = str(err)
    return result


def test_fused_backward_under_ddp_and_refusals(tmp_path):
    ranks = run_distributed(_worker, 2, args=(str(tmp_path),))
    for result in ranks:
        assert result["lomo_vs_sgd"] < 1e-6  # LOMO == SGD under DDP: averaged gradients, scheduled lr, clipping
        losses = result["adalomo_losses"]
        assert losses[-1] < losses[0] - 0.05, losses  # falls (the first step has lr 0: warmup)
        assert "one process only" in result["ddp/galore_adamw_layerwise"], result["ddp/galore_adamw_layerwise"]
        assert "not DDP with world size 2" in result["ddp/galore_adamw_layerwise"]
        assert "one process or DDP" in result["fsdp/adalomo"] and "not FSDP with world size 2" in result["fsdp/adalomo"]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name  # the replicas never drift
