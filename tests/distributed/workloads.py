"""Training workloads shared by the distributed tests: a tiny Llama on the shipped text.

Functions here run inside spawned ranks (harness.run_distributed), so they are top level and take
only picklable arguments: strategy and precision are given by name and built in the child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardkit import Runner
from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.precision import precision_from_name
from shardkit.strategies import strategy_from_name

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)


def build(strategy: str, precision: str, *, seed: int = 0, accum: int = 1, dropout: float = 0.1,
          batch_size: int = 4, lr: float = 1e-2, strategy_kwargs: dict | None = None, config=None):
    """Runner, model, optimizer, scheduler and loader, built the same way on every call."""
    runner = Runner(strategy_from_name(strategy, **(strategy_kwargs or {})), precision_from_name(precision),
                    gradient_accumulation_steps=accum, seed=seed)
    with runner.init_module():
        model = Llama(LlamaConfig(**{**TINY.to_dict(), "dropout": dropout}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer, scheduler = runner.setup(model, optimizer, scheduler)
    # 9219 bytes / stride 16 = 575 windows: an epoch is far longer than any test, so saves are mid-epoch.
    dataset = ByteTextDataset(TEXT, seq_len=16, stride=16)
    loader = runner.setup_dataloader(DataLoader(dataset, batch_size=batch_size, shuffle=True))
    return runner, model, optimizer, scheduler, loader


def train(runner: Runner, model, loader, steps: int, max_grad_norm: float | None = 1.0) -> list[float]:
    """Run until ``steps`` more optimizer steps were attempted; return each micro-batch's local loss."""
    losses: list[float] = []
    target = runner.optimizer_steps + steps
    attempts = 0
    while attempts < steps:
        for batch in loader:
            loss = model(batch["input_ids"], batch["labels"])
            runner.backward(loss)
            losses.append(loss.item())
            if runner.sync_gradients:
                if max_grad_norm:
                    runner.clip_gradients(max_grad_norm)
                runner.step()
                attempts += 1
                if attempts == steps:
                    break
    assert runner.optimizer_steps <= target
    return losses


def full_state(runner: Runner, model) -> dict[str, torch.Tensor]:
    """The model's full fp32 weights as plain CPU tensors (gathered where the strategy shards)."""
    module = runner.unwrap_model(model)
    out = {}
    # ZeRO-3 holds only partitions outside this context, so the copies are taken inside it.
    with runner.gathered_parameters(list(module.parameters())):
        for key, value in module.state_dict().items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[key] = value.detach().float().cpu().clone()
    return out


def resume_run(strategy: str, precision: str, ckpt: str | None, phase: str, steps: int,
               accum: int = 1, strategy_kwargs: dict | None = None, teardown: bool = True) -> dict[str, Any]:
    """One phase of an exact-resume check: "full" trains 2N, "first" trains N and saves, "second" loads and trains N.
    ``teardown=False`` keeps the process group for a next phase in this process (see :func:`resume_runs`)."""
    runner, model, optimizer, scheduler, loader = build(strategy, precision, accum=accum,
                                                        strategy_kwargs=strategy_kwargs)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    if phase == "second":
        values = runner.load(ckpt, state)
        assert values["step"] == steps, values
    losses = train(runner, model, loader, 2 * steps if phase == "full" else steps)
    if phase == "first":
        state["step"] = steps
        runner.save(Path(ckpt) / "step-1", state)
    result = {"losses": losses, "weights": full_state(runner, model),
              "scale": runner.precision.current_loss_scale, "steps": runner.optimizer_steps}
    if teardown:
        runner.teardown()
    return result


def resume_runs(runs: list[tuple[str, str, str | None, str]], steps: int, accum: int = 1) -> list[dict[str, Any]]:
    """:func:`resume_run` for each ``(strategy, precision, ckpt, phase)`` in turn, each with a fresh Runner and all
    in this launch's process group, which is released once, after the last. (Released between phases, the next
    phase's rendezvous on the same port could meet a peer's store not yet closed: a gloo connect timeout.)"""
    return [resume_run(*run, steps, accum, teardown=i == len(runs) - 1) for i, run in enumerate(runs)]
