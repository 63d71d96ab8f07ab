"""SFT batches on a long-tailed length distribution: padded vs BFD packing vs padding-free, and TRL's SFTTrainer.

    python benchmarks/sft.py [--steps 14] [--warmup 6] [--rounds 4] [--max-length 512] [--hidden 256] [--layers 4]

Same tiny HF Llama (random weights), same pre-tokenized data for every contender: sequence lengths drawn from a
log-normal (median ~90 tokens, a tail cut at --max-length), so a padded batch is mostly padding. Each contender
is timed in rounds, one child process a round running every contender, the order rotating so that each takes
every place; medians over the rounds are printed. Peak memory comes from one child process per contender.

- tokens/s: real (non-padding) tokens trained per second of wall clock, timed over the steps after --warmup;
  and per second of the process's CPU time (all its threads), which other jobs on a shared machine disturb less;
- padding: the fraction of the tokens in the batches that are padding (compute spent on nothing);
- peak memory: the training's peak resident set over what was resident when it started (VmHWM after
  /proc/self/clear_refs), measured in a run of its own with glibc's mmap threshold at 1 MiB so that freed
  blocks leave the resident set (see benchmarks/_timing.py). That setting makes every large allocation fault
  fresh pages in, several times slower, so the speed runs go without it.

Contenders: shardkit's SFTTrainer padded (no packing), BFD packing in padded rows, BFD packing padding-free (the
default with packing=True), and TRL's SFTTrainer with packing (BFD, padding-free: its default) on the same model and
data. TRL is not a shardkit requirement: ``pip install trl`` in the benchmark's environment (1.16.0 was measured;
it leaves torch and transformers as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import fmt_bytes, machine_description, print_table  # noqa: E402

CONTENDERS = {
    "shardkit padded": dict(packing=False, padding_free=False),
    "shardkit BFD packed rows": dict(packing=True, padding_free=False),
    "shardkit BFD padding-free": dict(packing=True, padding_free=True),
    "TRL BFD padding-free": dict(trl=True, packing=True, padding_free=True),
}


def _data(n: int, max_length: int, vocab: int, seed: int = 0):
    import datasets
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(4.5, 0.9).sample((n,)).clamp(8, max_length).long().tolist()
    rows = [{"input_ids": torch.randint(4, vocab, (length,), generator=generator).tolist()} for length in lengths]
    return datasets.Dataset.from_list(rows)


def _model(hidden: int, layers: int, vocab: int, max_length: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 64, max_position_embeddings=max_length,
                                      use_cache=False, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Counter:
    """Wraps a collator: real and total tokens of every batch."""

    def __init__(self, collator):
        self.collator, self.real, self.total = collator, [], []

    def __call__(self, examples):
        batch = self.collator(examples)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self.total.append(int(ids.numel()))
        if mask is not None:
            self.real.append(int(mask.sum()))
        else:  # padding-free, or packed rows padded with pad_token_id at the end
            self.real.append(int(sum(len(e["input_ids"]) for e in examples)))
        return batch


def _tokenizer(vocab: int):
    from shardkit.sft import train_tokenizer

    text = (Path(__file__).resolve().parents[1] / "examples" / "data" / "public_domain.txt")
    return train_tokenizer([text], vocab_size=vocab, chat_template=None)


def _child(name: str, args: argparse.Namespace) -> dict:
    import torch

    spec = CONTENDERS[name]
    vocab = 1024
    tokenizer = _tokenizer(vocab)
    data = _data(args.samples, args.max_length, len(tokenizer))
    model = _model(args.hidden, args.layers, len(tokenizer), args.max_length)
    out = tempfile.TemporaryDirectory(prefix="sft-bench-")  # save_strategy="no": nothing is written in it
    common = dict(output_dir=out.name, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-4,
                  logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True,
                  max_length=args.max_length, packing=spec["packing"], padding_free=spec["padding_free"], seed=0)
    if spec.get("trl"):
        import trl

        config = trl.SFTConfig(**common, dataloader_drop_last=False, bf16=False, gradient_checkpointing=False)
        trainer = trl.SFTTrainer(model, args=config, train_dataset=data, processing_class=tokenizer)
        callback_base = __import__("transformers").TrainerCallback
    else:
        from shardkit.sft import SFTConfig, SFTTrainer
        from shardkit.trainer import TrainerCallback as callback_base

        trainer = SFTTrainer(model, SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    counter = _Counter(trainer.data_collator)
    trainer.data_collator = counter
    marks = []

    class Clock(callback_base):
        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter(), time.process_time()))

    trainer.add_callback(Clock)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    trainer.train()
    peak = (_rss_kib("VmHWM") - before) * 1024
    out.cleanup()
    # Steps after --warmup: a fresh process's first steps fault pages in and warm the allocator, several times slower.
    timed = slice(args.warmup, args.steps)
    wall, cpu = (marks[args.steps - 1][i] - marks[args.warmup - 1][i] for i in (0, 1))
    real = sum(counter.real[timed])
    return {"tokens_per_s": real / wall, "tokens_per_cpu_s": real / cpu,
            "padding": 1 - sum(counter.real) / sum(counter.total), "peak": peak, "threads": torch.get_num_threads()}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _run_child(names: list[str], args: argparse.Namespace, mmap_threshold: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    parent_only = ("child", "only", "rounds", "peak_memory")
    command = [sys.executable, __file__, "--child", ",".join(names)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in parent_only]
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [json.loads(x[7:]) for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or len(lines) != len(names):
        raise RuntimeError(f"{names} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=6, help="steps before the timing starts")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="rows (padded) or bins (packed) per step")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="contender names to run")
    parser.add_argument("--no-peak-memory", dest="peak_memory", action="store_false",
                        help="skip the peak-memory runs (one child per contender; each as long as a round)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        for name in args.child.split(","):
            print("RESULT " + json.dumps({"name": name, **_child(name, args)}), flush=True)
        return
    names = [n for n in CONTENDERS if args.only is None or n in args.only]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):  # one process a round, every contender in it, the order rotating
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for result in _run_child(order, args, mmap_threshold=False):
            results[result["name"]].append(result)
            # NOTE: one line per contender and round as it lands: a round took 27 min at load 13 (2026-11-26),
            # and a run stopped early still leaves its finished rounds.
            print(f"round {round_ + 1}: {result['name']}: {result['tokens_per_s']:.0f} tokens/s, "
                  f"{result['tokens_per_cpu_s']:.0f} tokens/CPU-s (load {os.getloadavg()[0]:.1f})", flush=True)
    peaks = {name: _run_child([name], args, mmap_threshold=True)[0]["peak"] if args.peak_memory else None
             for name in names}
    print(f"{machine_description()}; load average at the end {os.getloadavg()[0]:.1f}")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    rows = []
    for name in names:
        wall, cpu = median(name, "tokens_per_s"), median(name, "tokens_per_cpu_s")
        rows.append([name, f"{wall:.0f}", f"{cpu:.0f}", f"{cpu / median(names[0], 'tokens_per_cpu_s'):.2f}",
                     f"{results[name][0]['padding']:.1%}", "-" if peaks[name] is None else fmt_bytes(peaks[name])])
    print_table(["contender", "real tokens/s", "real tokens/CPU-s", f"CPU-s rate vs {names[0]}", "padding",
                 "peak memory"], rows)


if __name__ == "__main__":
    main()
