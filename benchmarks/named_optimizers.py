"""Every optimizer in shardkit's registry side by side: seconds per step and optimizer-state bytes, one run.

    python benchmarks/named_optimizers.py [--steps 30] [--rounds 3] [--hidden 128] [--only adamw_torch,sgd]
    python benchmarks/named_optimizers.py --adamw-step [--hidden 128,512]

On a tiny shardkit Llama through shardkit's Trainer (``optim=<name>``), one process, one thread: seconds per
optimizer step (median of the steps after the first 5; best of ``--rounds`` rounds, the rows alternating so
machine noise hits each) and the bytes of optimizer state after training (GaLore's projection matrices
included; a layer-wise optimizer's per-parameter optimizers counted). Rows that need a GPU here say so.
max_grad_norm=0 for every row (LOMO/AdaLomo would run one more backward per step to measure the norm).

``--adamw-step`` times ``optimizer.step()`` alone for the AdamW rows (torch's fused, foreach, and shardkit's
FusedAdamW) on the same models' parameters with fixed gradients, 100 alternating repeats: which one the
Trainer's default ``optim`` should be.
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
from shardkit.optim import available_optimizers
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "public_domain.txt"
GALORE = dict(optim_target_modules="all-linear", optim_args={"rank": 16, "update_proj_gap": 50, "scale": 0.25})
# Learning rates that train the tiny model (the loss column shows it); the rest of each row is its default.
LR = {"sgd": 0.3, "schedule_free_sgd": 0.3, "adafactor": 0.05, "lomo": 0.1, "adalomo": 0.05,
      "schedule_free_radam": 1e-2}


class Clock(TrainerCallback):
    def __init__(self):
        self.begin: dict[int, float] = {}
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin[state.global_step] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.begin[state.global_step - 1])


def _tensor_bytes(value) -> int:
    ortho = getattr(value, "ortho_matrix", None)  # GaLore's projector
    pieces = [value] if isinstance(value, torch.Tensor) else (list(ortho) if isinstance(ortho, (list, tuple))
                                                              else [ortho])
    return sum(t.numel() * t.element_size() for t in pieces if isinstance(t, torch.Tensor))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer's state (and in the per-parameter optimizers of a layer-wise one)."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return sum(state_bytes(o) for o in inner)
    return sum(_tensor_bytes(v) for entry in optimizer.state.values() for v in entry.values())


def run(name: str, hidden: int, steps: int, out: str) -> tuple[float, int, float, float, int]:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=4, num_heads=4,
                         max_position=64)
    torch.manual_seed(0)
    model = Llama(config)
    text = ByteTextDataset(TEXT, seq_len=64, stride=64)
    data = Subset(text, range(min(len(text), 8 * steps)))
    extra = GALORE if name.startswith("galore") else {}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, logging_steps=5,
                             save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0, warmup_steps=2,
                             weight_decay=0.0, optim=name, learning_rate=LR.get(name, 1e-3), **extra)
    clock = Clock()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = sum(p.numel() for p in model.parameters())
    return statistics.median(clock.seconds[5:]), state_bytes(trainer.optimizer), losses[0], losses[-1], params


def adamw_step_table(hiddens: list[int], repeats: int = 100) -> None:
    names = ("adamw_torch_fused", "adamw_shardkit", "adamw_torch_foreach")
    print("| parameters | " + " | ".join(f"{n} ms/step (median, min)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for hidden in hiddens:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=4, num_heads=4,
                             max_position=64)
        torch.manual_seed(0)
        params = list(Llama(config).parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        from shardkit.optim import create_optimizer

        optimizers = {n: create_optimizer(n, params, lr=1e-3) for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeats):
            for name, optimizer in optimizers.items():
                start = time.perf_counter()
                optimizer.step()
                times[name].append(time.perf_counter() - start)
        cells = [f"{statistics.median(times[n][5:]) * 1e3:.2f}, {min(times[n][5:]) * 1e3:.2f}" for n in names]
        print(f"| {sum(p.numel() for p in params):,} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", default="128", help="hidden size (--adamw-step: comma-separated sizes)")
    parser.add_argument("--only", default="", help="comma-separated names (default: every registered one)")
    parser.add_argument("--adamw-step", action="store_true", help="time optimizer.step() of the AdamW rows only")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.adamw_step:
        adamw_step_table([int(h) for h in opts.hidden.split(",")])
        return
    opts.hidden = int(opts.hidden)
    names = [n for n in opts.only.split(",") if n] or available_optimizers()
    best: dict[str, list] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for name in names:
                if name in skipped:
                    continue
                try:
                    result = run(name, opts.hidden, opts.steps, f"{tmp}/{name}-{round_}")
                except (ValueError, ImportError) as err:  # e.g. bitsandbytes' 8-bit kernels without CUDA
                    skipped[name] = f"{type(err).__name__}: {str(err).split(':')[0]}"
                    continue
                if name not in best or result[0] < best[name][0]:
                    best[name] = list(result)
    params = next(iter(best.values()))[4]
    print(f"tiny shardkit Llama: hidden {opts.hidden}, 4 layers, {params:,} parameters ({params * 4:,} B fp32); "
          f"batch 8 x 64 tokens; {opts.steps} steps; best of {opts.rounds} rounds; 1 thread; torch "
          f"{torch.__version__}")
    print("| optim | s/step | optimizer state bytes | state / params bytes | loss (steps 1-5 -> last 5) |")
    print("|---|---|---|---|---|")
    for name, (sec, nbytes, first, last, _) in best.items():
        print(f"| {name} | {sec:.4f} | {nbytes:,} | {nbytes / (params * 4):.2f} | {first:.3f} -> {last:.3f} |")
    for name, why in skipped.items():
        print(f"| {name} | not run: {why} | | | |")


if __name__ == "__main__":
    main()
