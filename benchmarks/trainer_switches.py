"""Gradient checkpointing and fused kernels in the Trainer: peak memory and seconds per step of a tiny Hugging Face
Llama with each switch off and on, all in one run (one process, the same data and seed for every row).

    python benchmarks/trainer_switches.py [--hidden 256] [--layers 4] [--seq 512] [--batch 4] [--vocab 32000]
                                          [--steps 4] [--rounds 2]

Rows: neither switch, ``gradient_checkpointing=True``, ``use_fused_kernels=True`` (shardkit.nn.apply_fused_kernels:
RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy, which never builds the (tokens, vocab) logits), both.

Peak memory is per optimizer step: what the step adds at its peak over what is live between steps (weights,
optimizer state), i.e. activations, logits, gradients and temporaries. On CPU it is the process's resident set
(``VmHWM`` reset through /proc/self/clear_refs at each step's start), measured in a child process whose glibc
mmap threshold is fixed at 1 MiB so freed blocks go back to the OS (see ``_timing.py``), one step after a warm-up
step; the times are taken in this process, with the usual malloc. On CUDA: ``torch.cuda.max_memory_allocated``,
in this process. The first step of a row (it creates the optimizer state) is not measured; the time is the median
of the other steps over every round (the rows alternate round by round), the peak their maximum.
The table prints ratios to the row with both switches off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import _MMAP_ENV, _status_kib, fmt_bytes, machine_description, print_table
from torch.utils.data import Dataset

from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

ROWS = (("neither", {}), ("gradient_checkpointing", {"gradient_checkpointing": True}),
        ("use_fused_kernels", {"use_fused_kernels": True}),
        ("both", {"gradient_checkpointing": True, "use_fused_kernels": True}))
_RESULT = "RESULT "


class Tokens(Dataset):
    def __init__(self, rows: int, seq: int, vocab: int):
        self.rows, self.seq, self.vocab = rows, seq, vocab

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class StepMeter(TrainerCallback):
    """Seconds and peak added bytes of each optimizer step (from on_step_begin to on_step_end)."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.peaks = cuda, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._before = _status_kib("VmRSS") * 1024
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - self._before
        else:
            peak = _status_kib("VmHWM") * 1024 - self._before
        self.seconds.append(time.perf_counter() - self._start)
        self.peaks.append(peak)


def _model(args):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                      max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def measure(args, switches: dict, out: str) -> dict:
    cuda = torch.cuda.is_available()
    meter = StepMeter(cuda)
    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                              learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=10_000,
                              save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch", **switches)
    model = _model(args)
    if cuda:
        model = model.cuda()
    trainer = Trainer(model, targs, train_dataset=Tokens(args.steps * args.batch, args.seq, args.vocab),
                      callbacks=[meter])
    result = trainer.train()
    del trainer, model
    gc.collect()
    return {"seconds": meter.seconds[1:], "peak": meter.peaks[1:], "loss": result.training_loss}


def run_rows(args, rounds: int) -> dict[str, dict]:
    """Every row ``rounds`` times, alternating (a busy spell of the machine hits every row alike)."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in ROWS}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            for name, switches in ROWS:
                runs[name].append(measure(args, switches, out))
    return {name: {"seconds": statistics.median(s for r in rs for s in r["seconds"]),
                   "peak": max(p for r in rs for p in r["peak"]), "loss": rs[0]["loss"]} for name, rs in runs.items()}


def memory_pass(args) -> dict[str, dict]:
    """The rows in a child process whose freed blocks go back to the OS, so its peak RSS measures (see _timing.py).

    Timing stays in this process, with glibc's usual malloc: the fixed 1 MiB mmap threshold makes every large
    tensor fresh pages, so a row that allocates less would also look faster for that reason alone.
    """
    env = {**os.environ, _MMAP_ENV: str(1 << 20)}
    argv = [sys.executable, __file__, *sys.argv[1:], "--pass", "memory", "--rounds", "1", "--steps", "2"]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith(_RESULT))
    return json.loads(line[len(_RESULT):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per row; the first is not measured")
    parser.add_argument("--rounds", type=int, default=2, help="times each row is timed (rows alternate)")
    parser.add_argument("--pass", dest="which", choices=("all", "memory"), default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    cuda = torch.cuda.is_available()
    if args.which == "memory":
        print(_RESULT + json.dumps(run_rows(args, 1)), flush=True)
        return
    results = run_rows(args, args.rounds)
    if not cuda:
        for name, row in memory_pass(args).items():
            results[name]["peak"] = row["peak"]
    base = results["neither"]
    memory = "torch.cuda.max_memory_allocated" if cuda else "peak RSS of a step (child process, mmap threshold 1M)"
    print(f"\nTrainer on HF LlamaForCausalLM hidden={args.hidden} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}, time: median of {args.rounds} x {args.steps - 1} steps; memory: "
          f"{memory}; {machine_description('cuda' if cuda else 'cpu')}")
    rows = [[name, fmt_bytes(r["peak"]), f"{r['peak'] / base['peak']:.2f}", f"{r['seconds']:.3f}",
             f"{r['seconds'] / base['seconds']:.2f}", f"{r['loss']:.4f}"] for name, r in results.items()]
    print_table(["switches on", "peak per step", "x neither", "s/step", "x neither", "train loss"], rows)


if __name__ == "__main__":
    main()
