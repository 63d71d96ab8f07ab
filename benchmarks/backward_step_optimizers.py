"""Optimizers that update inside backward (LOMO, AdaLomo, layer-wise GaLore) beside adamw_torch, one run.

    python benchmarks/backward_step_optimizers.py [--steps 30] [--rounds 3] [--hidden 128]

On a tiny shardkit Llama through shardkit's Trainer, one process: seconds per optimizer step (median of the
steps after the first 5, best round of the rows alternating so machine noise hits each) and the bytes of
optimizer state after training (GaLore's projection matrices included). max_grad_norm=0 for every row:
with clipping, LOMO/AdaLomo measure the norm in one more backward per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Subset

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "public_domain.txt"
GALORE = dict(optim_target_modules="all-linear", optim_args={"rank": 16, "update_proj_gap": 50, "scale": 0.25})
ROWS = {
    "adamw_torch": dict(optim="adamw_torch", learning_rate=1e-3),
    "lomo": dict(optim="lomo", learning_rate=0.1),
    "adalomo": dict(optim="adalomo", learning_rate=0.05),
    "galore_adamw_layerwise": dict(optim="galore_adamw_layerwise", learning_rate=1e-3, **GALORE),
    "galore_adafactor_layerwise": dict(optim="galore_adafactor_layerwise", learning_rate=1e-3, **GALORE),
}


class Clock(TrainerCallback):
    def __init__(self):
        self.begin: dict[int, float] = {}
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin[state.global_step] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.begin[state.global_step - 1])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer's per-parameter state (GaLore's projector matrices included)."""
    total = 0
    for entry in optimizer.state.values():
        for value in entry.values():
            ortho = getattr(value, "ortho_matrix", None)
            pieces = [value] if isinstance(value, torch.Tensor) else (
                list(ortho) if isinstance(ortho, (list, tuple)) else [ortho])
            total += sum(t.numel() * t.element_size() for t in pieces if isinstance(t, torch.Tensor))
    return total


def run(row: str, hidden: int, steps: int, out: str) -> tuple[float, int, float, float, int]:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=4, num_heads=4,
                         max_position=64)
    torch.manual_seed(0)
    model = Llama(config)
    text = ByteTextDataset(TEXT, seq_len=64, stride=64)
    data = Subset(text, range(min(len(text), 8 * steps)))  # the Trainer runs more epochs when it is short
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, logging_steps=5,
                             save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0, warmup_steps=2,
                             weight_decay=0.0, **ROWS[row])
    clock = Clock()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = sum(p.numel() for p in model.parameters())
    return statistics.median(clock.seconds[5:]), state_bytes(trainer.optimizer), losses[0], losses[-1], params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    best: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for row in ROWS:
                result = run(row, opts.hidden, opts.steps, f"{tmp}/{row}-{round_}")
                if row not in best or result[0] < best[row][0]:
                    best[row] = list(result)
    params = next(iter(best.values()))[4]
    print(f"tiny shardkit Llama: hidden {opts.hidden}, 4 layers, {params:,} parameters ({params * 4:,} B fp32); "
          f"batch 8 x 64 tokens; {opts.steps} steps; best of {opts.rounds} rounds; 1 thread; torch "
          f"{torch.__version__}")
    print("| optim | s/step | optimizer state bytes | state / params bytes | loss (steps 1-5 -> last 5) |")
    print("|---|---|---|---|---|")
    for row, (sec, nbytes, first, last, _) in best.items():
        print(f"| {row} | {sec:.4f} | {nbytes:,} | {nbytes / (params * 4):.2f} | {first:.3f} -> {last:.3f} |")


if __name__ == "__main__":
    main()
