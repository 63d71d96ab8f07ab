"""shardkit's Trainer against Hugging Face's Trainer on the same tiny HF Llama, data and arguments, one process.

    python benchmarks/trainer.py [--steps 40] [--rounds 3] [--resume-steps 5000]

1. Seconds per optimizer step, the two Trainers alternating in rounds so machine noise hits both
   (ratio ours / HF; goal <= 1.0). Timed from the end of step 5 to the end of the last step.
2. Time from ``train(resume_from_checkpoint=True)`` to the first step after resuming from a checkpoint
   taken ``--resume-steps`` steps into an epoch, and from one taken 50 steps in: HF replays and skips the
   batches before the position; shardkit restores it directly (goal: the same at 50 and at 5,000).
Needs `transformers` and `accelerate` (requirements-test.txt).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from torch.utils.data import Subset

from shardkit.models import ByteTextDataset
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "public_domain.txt"


def _model(hidden: int):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _callbacks(base):
    class Clock(base):
        def __init__(self):
            self.marks, self.first_begin = {}, None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_begin is None:
                self.first_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.marks[state.global_step] = time.perf_counter()

    return Clock


OURS, THEIRS = _callbacks(TrainerCallback), _callbacks(transformers.TrainerCallback)


def _run(kind: str, out: str, data, hidden: int, steps: int, save_steps: int | None = None,
         resume: bool = False, batch: int = 4) -> tuple:
    common = dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1, learning_rate=1e-3,
                  max_steps=steps, lr_scheduler_type="constant", logging_steps=10_000, report_to="none",
                  disable_tqdm=True, seed=0, save_strategy="steps" if save_steps else "no",
                  save_steps=save_steps or 500)
    if kind == "ours":
        clock = OURS()
        trainer = Trainer(_model(hidden), TrainingArguments(**common), train_dataset=data, callbacks=[clock])
    else:
        clock = THEIRS()
        args = transformers.TrainingArguments(**common, use_cpu=True)
        trainer = transformers.Trainer(_model(hidden), args, train_dataset=data, callbacks=[clock])
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resume else None)
    return clock, start


def step_times(data, hidden: int, steps: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(rounds):
        for kind in ("hf", "ours"):
            with tempfile.TemporaryDirectory() as out:
                clock, _ = _run(kind, out, data, hidden, steps)
            times[kind].append((clock.marks[steps] - clock.marks[5]) / (steps - 5))
    return {k: statistics.median(v) for k, v in times.items()}


def resume_time(kind: str, data, hidden: int, position: int, root: Path) -> float:
    out = str(root / f"{kind}-{position}")
    # Batch 1: the ~9,200 windows of the text are ~9,200 steps per epoch, so 5,000 is mid-epoch.
    _run(kind, out, data, hidden, position, save_steps=position, batch=1)
    clock, start = _run(kind, out, data, hidden, position + 2, resume=True, batch=1)
    shutil.rmtree(out, ignore_errors=True)
    return clock.first_begin - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--resume-steps", type=int, default=5000)
    cli = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    data = ByteTextDataset(TEXT, seq_len=32, stride=1)  # overlapping windows: one per byte, ~9,200
    per_epoch = len(data)
    if cli.resume_steps >= per_epoch:
        raise SystemExit(f"--resume-steps {cli.resume_steps} must be < {per_epoch} steps per epoch of this data")
    times = step_times(Subset(data, range(2048)), cli.hidden, cli.steps, cli.rounds)
    print(f"seconds/step  HF {times['hf'] * 1e3:.2f} ms  shardkit {times['ours'] * 1e3:.2f} ms  "
          f"ratio {times['ours'] / times['hf']:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        for position in (50, cli.resume_steps):
            hf = resume_time("hf", data, cli.hidden, position, Path(tmp))
            ours = resume_time("ours", data, cli.hidden, position, Path(tmp))
            print(f"resume to first step at step {position:5d}  HF {hf:.3f} s  shardkit {ours:.3f} s")


if __name__ == "__main__":
    main()
