"""DPO training step: shardkit's DPOTrainer against TRL's, same tiny HF Llama, same rows, at vocabularies 32k and 128k.

    python benchmarks/dpo.py [--vocab 32000 128000] [--hidden 64] [--layers 2] [--pairs 8] [--steps 4] [--warmup 2]
                             [--completion 96] [--parallel]

Each (contender, vocabulary) runs in a child process of its own, with glibc's mmap threshold at 1 MiB so that freed
blocks leave the resident set (see benchmarks/_timing.py); both contenders run under the same setting.

- step time: the median wall time of the optimizer steps after --warmup (a TrainerCallback's on_step_end);
- peak memory: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) from just before the
  trainer is built to the end of training, over what was resident then: the reference copy, the optimizer state,
  the gradients, the activations and whatever the log-probabilities take.

Both trainers get the policy and a separate frozen reference (TRL: ``ref_model=`` a copy; shardkit: its default
copy), fp32 on CPU, AdamW, no gradient checkpointing. TRL is not a shardkit requirement (1.16.0 was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import fmt_bytes, machine_description, print_table, status_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river ran fast and cold under the old stone bridge while the children watched from the bank and the "
         "miller counted sacks of grain in the yard behind the house").split()


def _rows(pairs: int, completion: int) -> list[dict[str, str]]:
    def text(start: int, n: int) -> str:
        return " " + " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))

    return [{"prompt": text(i, 24).strip(), "chosen": text(3 * i + 1, completion - 7 * (i % 3)),
             "rejected": text(5 * i + 2, completion // 2 + 5 * (i % 4))} for i in range(pairs)]


def child(contender: str, opts: argparse.Namespace) -> dict:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from shardkit.sft.chat import train_tokenizer

    torch.manual_seed(0)
    tokenizer = train_tokenizer(texts=[" ".join(WORDS)] * 4, vocab_size=300)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=opts.vocab[0], hidden_size=opts.hidden,
                                         intermediate_size=2 * opts.hidden, num_hidden_layers=opts.layers,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512))
    import datasets

    data = datasets.Dataset.from_list(_rows(opts.pairs, opts.completion))
    times: list[float] = []

    class Clock(TrainerCallback):
        last = None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now

    settings = dict(output_dir=f"/tmp/dpo_bench_{contender}", per_device_train_batch_size=opts.pairs,
                    max_steps=opts.warmup + opts.steps, learning_rate=1e-4, report_to="none", save_strategy="no",
                    logging_steps=1, gradient_checkpointing=False, max_length=512, use_cpu=True, disable_tqdm=True)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    if contender == "trl":
        import trl

        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model),
                                 args=trl.DPOConfig(bf16=False, **settings), train_dataset=data,
                                 processing_class=tokenizer, callbacks=[Clock()])
    else:
        from shardkit.preference import DPOConfig, DPOTrainer
        from shardkit.trainer.callbacks import TrainerCallback as OurCallback

        class OurClock(Clock, OurCallback):  # Clock's on_step_end first (the base's is a no-op)
            pass

        trainer = DPOTrainer(model, args=DPOConfig(**settings), train_dataset=data, processing_class=tokenizer,
                             callbacks=[OurClock()])
    trainer.train()
    peak = status_bytes("VmHWM") - before
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step_s": statistics.median(times[opts.warmup - 1:]), "peak": peak, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=("shardkit", "trl"))
    parser.add_argument("--parallel", action="store_true",
                        help="run the four children at once (peak memory is per process; step times then share the "
                             "CPUs, each contender as much as the other)")
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(opts.child, opts)), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / ".pp"), os.environ.get("PYTHONPATH", "")])}
    print(f"machine: {machine_description()}; load average at start: {os.getloadavg()}", flush=True)
    table = []
    runs = {}
    for vocab in opts.vocab:
        for contender in ("trl", "shardkit"):
            args = [sys.executable, __file__, "--child", contender, "--vocab", str(vocab)] + \
                [f"--{k}={getattr(opts, k)}" for k in ("hidden", "layers", "pairs", "completion", "steps", "warmup")]
            runs[vocab, contender] = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True)
            if not opts.parallel:
                runs[vocab, contender].wait()
    results = {}
    for (vocab, contender), proc in runs.items():
        stdout, stderr = proc.communicate()
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{contender} at vocab {vocab} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
        results[vocab, contender] = json.loads(line[len("RESULT "):])
    for vocab in opts.vocab:
        trl_r, ours = results[vocab, "trl"], results[vocab, "shardkit"]
        table.append([f"{vocab:,}", f"{trl_r['step_s']:.3f}", f"{ours['step_s']:.3f}",
                      f"{trl_r['step_s'] / ours['step_s']:.2f}x", fmt_bytes(trl_r["peak"]), fmt_bytes(ours["peak"]),
                      f"{ours['peak'] / trl_r['peak']:.2f}", f"{trl_r['losses'][0]:.4f} / {ours['losses'][0]:.4f}"])
    print_table(["vocab", "TRL s/step", "shardkit s/step", "speed (TRL/shardkit)", "TRL peak", "shardkit peak",
                 "peak ratio (shardkit/TRL)", "first loss TRL / shardkit"], table)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
