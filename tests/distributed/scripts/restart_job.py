"""Run by `shardkit launch --max-restarts`: DDP on CPU, a checkpoint every 2 steps, resumed by `Runner.resume`.

    restart_job.py OUT --steps 20 --kill-seed 7   # attempts 0-2: one rank SIGKILLs itself at a random moment
    restart_job.py OUT --crash                    # every attempt raises at step 0

Each rank appends its (step, loss) to OUT/losses.<attempt>.rank<r>.jsonl as it trains. The attempt that finishes
writes OUT/final.rank<r>.pt: the trained weights and losses, and those of the same training run again from the
start in the same processes without a kill or a checkpoint (the uninterrupted reference).
"""

import argparse
import json
import os
import random
import signal
import threading
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardkit import Runner
from shardkit.distributed.restart_records import restart_facts
from shardkit.utils.seeding import seed_everything


def kill_plan(seed: int, steps: int, world: int, kills: int) -> list[tuple[int, int, float]]:
    """Per attempt: the step after which, the rank that, and the delay (s) after which it SIGKILLs itself."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(2, steps - 6), kills))
    return [(cut, rng.randrange(world), rng.uniform(0.0, 0.02)) for cut in cuts]


def build(runner: Runner):
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data))
    loader = runner.setup_dataloader(DataLoader(dataset, batch_size=4, shuffle=True))
    return model, optimizer, loader


def train(runner: Runner, steps: int, ckpt: str | None, on_step) -> tuple[dict, list]:
    model, optimizer, loader = build(runner)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if ckpt is not None:
        runner.resume(ckpt, state)
    losses = []
    while runner.optimizer_steps < steps:
        for x, y in loader:
            if on_step is not None:
                on_step(runner.optimizer_steps, None)
            loss = nn.functional.mse_loss(model(x), y)
            runner.backward(loss)
            runner.step()
            losses.append((runner.optimizer_steps, loss.item()))
            if on_step is not None:
                on_step(runner.optimizer_steps, loss.item())
            if ckpt is not None and runner.should(every=2):
                runner.save(f"{ckpt}/step-{runner.optimizer_steps:04d}", state)
            if runner.optimizer_steps >= steps:
                break
    weights = {k: v.detach().clone() for k, v in runner.unwrap_model(model).state_dict().items()}
    runner.release()
    return weights, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-seed", type=int, default=None)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--crash", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    facts = restart_facts()
    attempt = facts.attempt if facts is not None else 0
    runner = Runner("ddp", seed=0, checkpoint_keep_last=3)
    rank = runner.rank
    (out / f"started.{attempt}.rank{rank}").touch()
    log = open(out / f"losses.{attempt}.rank{rank}.jsonl", "a", buffering=1)
    plan = kill_plan(args.kill_seed, args.steps, runner.world_size, args.kills) if args.kill_seed is not None else []
    cut, victim, delay = plan[attempt] if attempt < len(plan) else (None, None, 0.0)
    # never before this attempt has gone beyond every earlier one: each kill then follows progress
    last = facts.last_step if facts is not None else -1
    armed = []

    def on_step(step: int, loss: float | None) -> None:
        if args.crash:
            raise RuntimeError(f"crash at step {step} on purpose")
        if loss is None:
            return
        log.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if cut is not None and rank == victim and step >= max(cut, last + 1) and not armed:
            armed.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)))
            armed[0].daemon = True
            armed[0].start()

    weights, losses = train(runner, args.steps, str(out / "ckpt"), on_step)
    runner.optimizer_steps = 0  # the same Runner trains the reference from the start
    reference, reference_losses = train(runner, args.steps, None, None)
    torch.save({"weights": weights, "reference": reference, "reference_losses": reference_losses,
                "last_losses": losses}, out / f"final.rank{rank}.pt")
    runner.teardown()


if __name__ == "__main__":
    main()
