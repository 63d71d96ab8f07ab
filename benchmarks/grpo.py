"""GRPO training step: shardkit's GRPOTrainer against TRL's, same tiny HF Llama, prompts, reward and settings, one
CPU process each, side by side.

    python benchmarks/grpo.py [--hidden 128] [--layers 2] [--vocab 2000] [--batch 16] [--generations 8]
                              [--completion 32] [--steps 6] [--warmup 2]

Each contender runs in a child process of its own (glibc's mmap threshold at 1 MiB so that freed blocks leave the
resident set, see benchmarks/_timing.py). Reported per contender:

- step time: the median wall time of the optimizer steps after --warmup (a TrainerCallback's on_step_end);
- generation share: the time spent sampling completions (TRL's ``_generate_single_turn``, shardkit's ``generate``)
  over the whole run's step time;
- rollout tokens/s: completion tokens sampled per second of sampling;
- peak memory: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) from just before the
  trainer is built to the end of training, over what was resident then.

Both: fp32, AdamW, no gradient checkpointing, beta=0 (no reference), loss_type="dapo", temperature 1, the EOS token
suppressed (``generation_kwargs``) so that every completion has --completion tokens on both sides. The libraries are
imported before the memory baseline. TRL is not a shardkit requirement (1.16.0 here). Not
measured here: 2 ranks under ZeRO-3 and DDP (the issue's figure); run it under ``shardkit launch`` yourself.
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


def child(contender: str, opts: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from shardkit.sft.chat import train_tokenizer

    torch.manual_seed(0)
    tokenizer = train_tokenizer(texts=[" ".join(WORDS)] * 4, vocab_size=300)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.hidden,
                                         intermediate_size=2 * opts.hidden, num_hidden_layers=opts.layers,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512))
    rows = [{"prompt": " ".join(WORDS[i % 7:i % 7 + 6])} for i in range(200)]
    times: list[float] = []
    sampled = {"tokens": 0, "seconds": 0.0}

    def reward(completion_ids, **kwargs):
        sampled["tokens"] += sum(len(c) for c in completion_ids)
        return [sum(t % 2 for t in c) / max(len(c), 1) for c in completion_ids]

    class Clock(TrainerCallback):
        last = None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now

    settings = dict(output_dir=f"/tmp/grpo_bench_{contender}", per_device_train_batch_size=opts.batch,
                    num_generations=opts.generations, max_completion_length=opts.completion,
                    max_steps=opts.warmup + opts.steps, learning_rate=1e-4, report_to="none", save_strategy="no",
                    logging_steps=1, use_cpu=True, disable_tqdm=True, beta=0.0, loss_type="dapo", seed=0,
                    generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]})
    if contender == "trl":
        import datasets
        import trl
    else:
        from shardkit.rl import GRPOConfig, GRPOTrainer
        from shardkit.trainer.callbacks import TrainerCallback as OurCallback
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    if contender == "trl":
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, train_dataset=datasets.Dataset.from_list(rows),
                                  args=trl.GRPOConfig(bf16=False, gradient_checkpointing=False, **settings),
                                  processing_class=tokenizer, callbacks=[Clock()])
        name = "_generate_single_turn"
    else:
        class OurClock(Clock, OurCallback):  # Clock's on_step_end first (the base's is a no-op)
            pass

        trainer = GRPOTrainer(model, reward, args=GRPOConfig(**settings), train_dataset=rows,
                              processing_class=tokenizer, callbacks=[OurClock()])
        name = "generate"
    inner = getattr(trainer, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sampled["seconds"] += time.perf_counter() - t

    setattr(trainer, name, timed)
    trainer.train()
    total = time.perf_counter() - start
    peak = status_bytes("VmHWM") - before
    return {"step_s": statistics.median(times[opts.warmup - 1:]), "peak": peak,
            "gen_share": sampled["seconds"] / total, "tokens_per_s": sampled["tokens"] / max(sampled["seconds"], 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=("shardkit", "trl"))
    opts = parser.parse_args()
    keys = ("vocab", "hidden", "layers", "batch", "generations", "completion", "steps", "warmup")
    if opts.child:
        print("RESULT " + json.dumps(child(opts.child, opts)), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / ".pp"), os.environ.get("PYTHONPATH", "")])}
    print(f"machine: {machine_description()}; load average at start: {os.getloadavg()}", flush=True)
    results = {}
    for contender in ("trl", "shardkit"):
        args = [sys.executable, __file__, "--child", contender] + [f"--{k}={getattr(opts, k)}" for k in keys]
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{contender} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[contender] = json.loads(line[len("RESULT "):])
    rows = [[c, f"{r['step_s']:.3f}", f"{r['gen_share']:.0%}", f"{r['tokens_per_s']:.0f}", fmt_bytes(r["peak"])]
            for c, r in results.items()]
    print_table(["contender", "s/step", "generation share", "rollout tokens/s", "peak memory"], rows)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
